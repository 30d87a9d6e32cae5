"""The built-in rewards as reward functions (marl/rewards/functions.py): the paper's math
and code rewards (§A.7), chosen by the problem's task when `reward.function` is unset.

    reward:
      function: marl.rewards.builtin:math_reward

`math_reward` also reports `any_format_correct` (whether the answer holds the right
value in any format), logged as `train/any_format_correct`. Its settings are the run's
`reward.format_penalty` and `reward.math_timeout_s`. `any_format_reward` pays that
`any_format_correct` instead, for a model that does not write `\boxed{}` yet.
"""

from __future__ import annotations

import asyncio
from typing import Any

from marl.problem import Problem


def problem_text(problem: Problem) -> str:
    """What the model was asked: the prompt, and the data's own chat messages when it gave
    them (an expression written there is no answer, `marl.rewards.math_scoring.check`)."""
    said = [m.get("content", "") for m in problem.messages or () if isinstance(m, dict)]
    return "\n".join([problem.prompt, *[s for s in said if isinstance(s, str)]])


async def math_reward(problem: Problem, answer: str, episode: Any) -> dict[str, float]:
    """1 when the last `\\boxed{}` equals the ground truth, 0 when not, the format penalty
    when none parses. Exact matches and remembered verdicts are scored on the event loop;
    otherwise both checks take one trip to a thread, not two."""
    from marl.rewards import math_scoring as math_reward_

    task = episode.task
    truth, penalty, timeout = problem.answer, task.format_penalty, task.math_timeout_s
    question = problem_text(problem)

    def both(remembered_only: bool) -> dict[str, float]:
        reward = math_reward_.score(answer, truth, penalty, timeout,
                                    remembered_only=remembered_only, question=question)
        right = math_reward_.any_format_correct(answer, truth, timeout,
                                                remembered_only=remembered_only,
                                                question=question)
        return {"score": reward, "any_format_correct": float(right)}

    try:
        return both(remembered_only=True)
    except math_reward_.Unsettled:
        return await asyncio.to_thread(both, False)


async def any_format_reward(problem: Problem, answer: str, episode: Any) -> dict[str, float]:
    """1 when the answer holds the right value in any format (the last boxed answer, else
    the last number; an expression of the problem's own text, `23+29` for "What is 23+29?",
    is still wrong), else 0. A model
    that never writes the box at first scores the same on every rollout under
    `math_reward` (all 0 or all the format penalty), which leaves GRPO no signal; this
    reward pays the answers it already gets right (docs/real-models.md)."""
    right = (await math_reward(problem, answer, episode))["any_format_correct"]
    return {"score": right, "any_format_correct": right}


async def code_reward(problem: Problem, answer: str, episode: Any) -> float:
    """The fraction of the problem's tests the answer's last Python block passes in the
    reward sandbox; 0 without runnable code or when any test timed out."""
    from marl.rewards import code_scoring

    return float(await code_scoring.score(answer, problem.tests, episode.sandbox()))
