"""Reward functions by name: verl's signature unchanged, components, failures that fail the
rollout naming the function; `workflow_args` checked by the workflow's own model."""

from __future__ import annotations

import math

import pytest

from marl.problem import Problem
from marl.rewards import functions
from marl.rewards.llm_judge import judge_prompt, verdict_score
from marl.spec.run import RunSpec, SpecError, parse_spec
from marl.workflows import policy_of_role
from services.workflow.worker import EpisodeRunner
from tests.support.workflows_scripted import MATH, ScriptedEngine, make_task, runner_with

USER = "tests.integration.byo_user"
VERL_PROBLEM = Problem(id="v1", prompt="What is 2 + 3?", answer="5", data_source="openai/gsm8k",
                       extra_info={"index": 1})


async def test_a_verl_signature_is_called_unchanged() -> None:
    scored = await functions.call(f"{USER}:compute_score", VERL_PROBLEM, "so it is 5", None, {})
    assert scored.score == 1.0
    # numeric components only: verl's `pred` string is dropped
    assert scored.components == {"acc": 1.0, "has_number": 1.0, "index_seen": 1.0}
    assert functions.is_verl(functions.resolve(f"{USER}:compute_score"))


@pytest.mark.parametrize(("name", "message"), [
    ("boom", "reward function tests.integration.byo_user:boom raised ValueError: the reward "
             "exploded"),
    ("not_a_number", "reward function tests.integration.byo_user:not_a_number returned nan"),
])
async def test_a_failing_function_is_a_reward_error_naming_it(name: str, message: str) -> None:
    with pytest.raises(functions.RewardError, match=message):
        await functions.call(f"{USER}:{name}", MATH, "x", None, {})


def test_return_values() -> None:
    assert functions.parse(1, "f").score == 1.0
    assert functions.parse({"score": 0.5, "len": 3, "note": "x"}, "f").components == {"len": 3.0}
    assert functions.parse({"score": 1, "role_rewards": {"a": 0}}, "f").role_rewards == {"a": 0.0}
    for bad in ({"value": 1}, "1", None, math.inf, {"score": 1, "role_rewards": {"a": "x"}}):
        with pytest.raises(functions.RewardError, match="reward function f"):
            functions.parse(bad, "f")


@pytest.mark.parametrize(("reward", "message"), [
    ({"function": "nope.nothing:fn"}, "field `reward.function`: cannot import module"),
    ({"function": f"{USER}:missing"}, "field `reward.function`: module .* has no function"),
    ({"function": f"{USER}:boom", "args": {"scale": 2}}, "field `reward.args`: .* does not take"),
    ({"args": {"scale": 2}}, "field `reward.args`: arguments for a reward function"),
    ({"function": "not a name"}, "field `reward.function`"),
])
def test_submit_checks_name_the_field(reward: dict, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        policy_of_role(parse_spec({"reward": reward}))


async def test_the_worker_fails_the_rollout_and_logs_components() -> None:
    engine = ScriptedEngine(lambda role, slot, prompt: "the answer is 5")
    runner: EpisodeRunner = runner_with(engine)
    task = make_task("single", problem=VERL_PROBLEM, reward_function=f"{USER}:compute_score")
    rollout = await runner.run(task)
    assert rollout.error is None and rollout.reward == 1.0
    assert rollout.facts["acc"] == 1.0 and rollout.facts["index_seen"] == 1.0
    task = make_task("single", reward_function=f"{USER}:boom")
    failed = await runner.run(task)
    assert failed.error is not None and "tests.integration.byo_user:boom" in failed.error
    assert failed.turns == [] and failed.reward == 0.0


async def test_role_rewards_reach_the_rollout() -> None:
    from marl.rollout import AdapterRef

    engine = ScriptedEngine(lambda role, slot, prompt: "5" if role == "drafter" else "no")
    task = make_task("single", reward_function=f"{USER}:roles_apart")
    task.workflow = "examples.workflows.openai_agent:AGENT"
    task.adapters = {r: AdapterRef(f"run-1/{r}", 7) for r in ("drafter", "checker")}
    rollout = await runner_with(engine).run(task)
    assert rollout.error is None, rollout.error
    assert rollout.role_rewards == {"drafter": 1.0, "checker": 0.0}


def test_the_default_is_the_builtin_reward_of_the_task() -> None:
    assert functions.default_for("math") == functions.BUILTIN_MATH
    assert functions.default_for("code") == functions.BUILTIN_CODE


@pytest.mark.parametrize(("args", "message"), [
    ({"rounds": 9}, r"field `workflow_args.rounds`: Input should be less than or equal to 3 "
                    r"\(got 9\)"),
    ({"rounds": "two"}, r"field `workflow_args.rounds`: Input should be a valid integer"),
    ({"round": 2}, r"field `workflow_args.round`: unknown field"),
])
def test_bad_workflow_args_name_the_field(args: dict, message: str) -> None:
    spec = parse_spec({"workflow": f"{USER}:ROUNDS", "workflow_args": args})
    with pytest.raises(SpecError, match=message):
        policy_of_role(spec)


def test_a_workflow_without_args_refuses_them() -> None:
    with pytest.raises(SpecError, match="field `workflow_args`: workflow 'single' takes no"):
        policy_of_role(RunSpec(workflow="single", workflow_args={"x": 1}))
    with pytest.raises(SpecError, match="field `workflow_args.x`: unknown field"):
        policy_of_role(RunSpec(workflow_args={"x": 1}))  # Voting takes aggregator_output


async def test_workflow_args_reach_the_workflow() -> None:
    engine = ScriptedEngine(lambda role, slot, prompt: "\\boxed{5}")
    task = make_task("single", workflow_args={"rounds": 3})
    task.workflow = f"{USER}:ROUNDS"
    task.adapters = {"solver": task.adapters["generator"]}
    rollout = await runner_with(engine).run(task)
    assert rollout.error is None, rollout.error
    assert len(rollout.turns) == 3 and rollout.facts["rounds_seen"] == 3.0


def test_judge_verdicts_and_prompt() -> None:
    assert verdict_score("fine. \\boxed{7}", 10) == 0.7
    assert verdict_score("I give it 12 of 10", 10) == 1.0
    assert verdict_score("no idea", 10) is None
    text = judge_prompt("{problem} | {reference} | {answer} | {other}", MATH, "5")
    assert text == "What is 2 + 3? | 5 | 5 | {other}"
