"""Any-format accuracy: the right value whatever the answer's format, and its mean per step."""

import asyncio
from types import SimpleNamespace

from marl.problem import Problem
from marl.rewards.builtin import any_format_reward
from marl.rewards.math_scoring import any_format_correct, loose_answer, score
from marl.rollout import Rollout, mean_facts


def test_loose_answer_prefers_the_box_then_the_last_number() -> None:
    assert loose_answer("so \\boxed{12} not 13") == "12"
    assert loose_answer("The answer is 42") == "42"
    assert loose_answer("it is -3.5 or 7/2") == "7/2"
    assert loose_answer("no digits here") is None


def test_any_format_counts_a_plain_right_answer_that_the_reward_penalises() -> None:
    assert score("The answer is 42", "42") == -0.1
    assert any_format_correct("The answer is 42", "42")
    assert any_format_correct("\\boxed{42}", "42")
    assert not any_format_correct("The answer is 41", "42")
    assert any_format_correct("\\boxed{0.5}", "\\frac{1}{2}")


def test_any_format_reward_pays_a_right_sum_in_any_format_but_not_the_question() -> None:
    p = Problem(id="p", task="math", prompt="What is 23+29?", answer="52")
    episode = SimpleNamespace(task=SimpleNamespace(format_penalty=-0.1, math_timeout_s=5.0))

    def reward(answer: str) -> dict[str, float]:
        return asyncio.run(any_format_reward(p, answer, episode))

    right = {"score": 1.0, "any_format_correct": 1.0}
    wrong = {"score": 0.0, "any_format_correct": 0.0}
    assert reward("23 + 29 = 52") == right
    assert reward("\\boxed{52}") == right
    assert reward("23 + 29 = 51") == wrong
    assert reward("\\boxed{23+29}") == wrong
    assert reward("no number") == wrong
    assert score("23 + 29 = 52", "52") == -0.1  # the strict reward's format penalty


def _rollout(facts: dict[str, float], error: str | None = None) -> Rollout:
    p = Problem(id="p", task="math", prompt="q", answer="1")
    return Rollout("t", "r", 1, "val", p.id, 0, [], "", 0.0, error=error, facts=facts)


def test_mean_facts_skips_failed_episodes_and_missing_facts() -> None:
    rollouts = [
        _rollout({"any_format_correct": 1.0, "rounds": 2.0}),
        _rollout({"any_format_correct": 0.0}),
        _rollout({"any_format_correct": 1.0}, error="UNAVAILABLE"),
    ]
    assert mean_facts(rollouts, "val") == {"val/any_format_correct": 0.5, "val/rounds": 2.0}
