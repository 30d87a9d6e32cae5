"""Workflows users write: `module:VALUE` in a spec, checked at submit time, run unchanged."""

from __future__ import annotations

import pytest

from marl.spec.run import RunSpec, SpecError, load_spec_text
from marl.workflows import Workflow, policy_of_role, resolve
from tests.support.workflows_scripted import ScriptedEngine, make_task, run_episode

DEBATE = "examples.workflows.debate:DEBATE"


async def test_the_debate_example_runs_two_solvers_twice_then_a_judge() -> None:
    def script(role: str, slot: int, prompt: str) -> str:
        return f"{role}{slot}-{prompt.count('Another')} \\boxed{{{slot}}}"

    engine = ScriptedEngine(script)
    task = make_task(DEBATE)
    episode, final = await run_episode(task, engine)
    order = [(s.role, s.slot) for s in engine.seen]
    assert sorted(order[:2]) == sorted(order[2:4]) == [("solver", 0), ("solver", 1)]
    assert order[4] == ("judge", 0)
    # each rebuttal shows the solver its own answer and the other's
    rebuttal_0 = next(s.prompt for s in engine.seen[2:4] if s.slot == 0)
    assert "solver0-0 \\boxed{0}" in rebuttal_0 and "solver1-0 \\boxed{1}" in rebuttal_0
    judge = engine.seen[4].prompt
    assert "solver0-1 \\boxed{0}" in judge and "solver1-1 \\boxed{1}" in judge
    assert final == "judge0-0 \\boxed{0}"
    assert {s.adapter for s in engine.seen} == {"run-1/solver@7", "run-1/judge@7"}
    assert episode.caps.extra == {"debate_rounds": 1}


def test_a_user_workflow_routes_like_a_built_in_one() -> None:
    assert policy_of_role(RunSpec(workflow=DEBATE, policy="isolated")) == {
        "solver": "solver", "judge": "judge"}
    assert policy_of_role(RunSpec(workflow=DEBATE)) == {"solver": "shared", "judge": "shared"}
    assert policy_of_role(
        RunSpec(workflow=DEBATE, policy_groups={"solver": "a", "judge": "b"})
    ) == {"solver": "a", "judge": "b"}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"workflow": "no_such_package.flows:DEBATE"}, r"field `workflow`: cannot import module "
                                                       r"'no_such_package.flows'"),
        ({"workflow": "examples.workflows.debate:NOPE"}, r"field `workflow`: module .* has no "
                                                         r"'NOPE'"),
        ({"workflow": "marl.spec.run:RunSpec"}, r"field `workflow`: .* not a marl.workflows.Workflow"),
        ({"workflow": DEBATE, "policy_groups": {"solver": "a"}},
         r"field `policy_groups`: must map every role .*missing roles \['judge'\]"),
        ({"workflow": "single", "policy_groups": {"solver": "a"}},
         r"field `policy_groups.solver`: .* now called `generator`"),
    ],
)
def test_bad_workflows_are_refused_at_submit_naming_the_field(spec: dict, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        policy_of_role(RunSpec(**spec))


def test_the_learner_submit_check_refuses_them_too() -> None:
    from marl.spec.services import LearnerConfig
    from services.learner.server import validate_spec

    with pytest.raises(SpecError, match="field `workflow`: cannot import module"):
        validate_spec("workflow: no_such_package.flows:DEBATE\nmodel: {path: demo}\n",
                      LearnerConfig(allowed_modules=["no_such_package"]))
    with pytest.raises(SpecError, match="field `workflow`: module 'no_such_package.flows' is "
                                        "not allowed.*MARL_LEARNER_ALLOWED_MODULES"):
        validate_spec("workflow: no_such_package.flows:DEBATE\nmodel: {path: demo}\n", LearnerConfig())


def test_a_malformed_workflow_name_is_refused_by_the_spec() -> None:
    with pytest.raises(SpecError, match=r"field `workflow`.*package.module:VALUE"):
        load_spec_text("workflow: 'my flows:X'")


def test_workflow_values_check_their_roles() -> None:
    async def run(episode, problem):  # type: ignore[no-untyped-def]
        return ""

    with pytest.raises(ValueError, match="lowercase identifiers"):
        Workflow(name="x", roles=("Bad Role",), run=run)
    with pytest.raises(ValueError, match="non-empty tuple"):
        Workflow(name="x", roles=(), run=run)
    with pytest.raises(ValueError, match="repeat"):
        Workflow(name="x", roles=("a", "a"), run=run)


def test_old_single_specs_still_run() -> None:
    assert policy_of_role(RunSpec(workflow="single", policy="isolated")) == {
        "generator": "generator"}
    assert resolve("single").roles == ("generator",)
