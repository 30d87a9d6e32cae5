"""Each built-in workflow against a scripted engine: the exact turns, slots, adapters, caps."""

from __future__ import annotations

import asyncio

import pytest

from marl.protocol.v1 import inference_pb2
from marl.spec.run import WorkflowCaps
from marl.workflows import prompts
from marl.workflows.eval_opt import verdict
from tests.support.workflows_scripted import CODE, MATH, ScriptedEngine, make_task, run_episode


def order(engine: ScriptedEngine) -> list[tuple[str, int]]:
    return [(s.role, s.slot) for s in engine.seen]


async def test_single_is_one_generator_turn_with_the_generator_prompt() -> None:
    engine = ScriptedEngine(lambda role, slot, prompt: "\\boxed{5}")
    episode, final = await run_episode(make_task("single"), engine)
    assert order(engine) == [("generator", 0)]
    assert engine.seen[0].adapter == "run-1/generator@7"
    assert engine.seen[0].prompt == prompts.generator(MATH)[0]["content"] + "\n\n"
    assert final == "\\boxed{5}"
    assert [t.role for t in episode.turns] == ["generator"]


@pytest.mark.parametrize("routing", ["isolated", "shared"])
async def test_voting_three_generators_then_an_aggregator_seeing_every_candidate(
    routing: str,
) -> None:
    answers = {0: "\\boxed{5}", 1: "\\boxed{ 5 }", 2: "\\boxed{4}"}

    def script(role: str, slot: int, prompt: str) -> str:
        return answers[slot] if role == "generator" else "Pick \\boxed{4}"

    engine = ScriptedEngine(script, delay_s=0.05)
    episode, final = await run_episode(make_task("voting", routing=routing), engine)
    assert sorted(order(engine)[:3]) == [("generator", s) for s in range(3)]
    assert order(engine)[3] == ("aggregator", 0)
    # the three generators were in flight together (each takes 50 ms)
    gens = engine.seen[:3]
    assert max(g.started for g in gens) < min(g.ended for g in gens)
    aggregator_prompt = engine.seen[3].prompt
    assert all(a in aggregator_prompt for a in answers.values())
    expected_adapter = {"isolated": "run-1/{}@7", "shared": "run-1/shared@7"}[routing]
    for seen in engine.seen:
        assert seen.adapter == expected_adapter.format(seen.role)
    assert final == "Pick \\boxed{4}"
    assert episode.facts == {
        "majority_agreement": 2 / 3,
        "oracle_pass_at_n": 1.0,
        "aggregator_picked_majority": 0.0,
    }


async def test_voting_candidates_follow_the_cap() -> None:
    engine = ScriptedEngine(lambda role, slot, prompt: f"\\boxed{{{slot + 1}}}")
    task = make_task("voting", caps=WorkflowCaps(voting_candidates=5))
    episode, _ = await run_episode(task, engine)
    assert sorted(order(engine)) == [("aggregator", 0)] + [("generator", s) for s in range(5)]
    assert "aggregator_picked_majority" not in episode.facts  # no two candidates agree
    assert episode.facts["majority_agreement"] == 1 / 5
    assert episode.facts["oracle_pass_at_n"] == 1.0


def eval_opt_script(verdicts: list[str]) -> ScriptedEngine:
    """The evaluator's k-th reply is verdicts[k]; the generator answers `\\boxed{k}`."""
    said: list[str] = []

    def script(role: str, slot: int, prompt: str) -> str:
        if role == "generator":
            return f"answer \\boxed{{{slot + 3}}}"
        said.append(verdicts[len(said)])
        return f"critique {len(said)}: {said[-1]}"

    return ScriptedEngine(script)


async def test_eval_opt_stops_at_the_first_correct() -> None:
    engine = eval_opt_script(["\\boxed{Incorrect}", "\\boxed{Incorrect}", "\\boxed{Correct}"])
    episode, final = await run_episode(make_task("eval_opt"), engine)
    assert order(engine) == [("generator", 0), ("evaluator", 0), ("generator", 1),
                             ("evaluator", 1), ("generator", 2), ("evaluator", 2)]
    assert final == "answer \\boxed{5}"
    # each evaluator sees the latest answer; each revision sees the answer and its critique
    assert "answer \\boxed{3}" in engine.seen[1].prompt
    assert "answer \\boxed{3}" in engine.seen[2].prompt
    assert "critique 1: \\boxed{Incorrect}" in engine.seen[2].prompt
    assert "answer \\boxed{4}" in engine.seen[3].prompt
    assert engine.seen[2].prompt == prompts.reviser(
        MATH, "answer \\boxed{3}", "critique 1: \\boxed{Incorrect}")[0]["content"] + "\n\n"
    # verdicts 1, 2 (Incorrect on wrong answers) and 3 (Correct on a right one) all hold
    assert episode.facts == {"rounds_used": 2.0, "verdict_parse_rate": 1.0,
                             "verdict_accuracy": 1.0}
    assert {s.adapter for s in engine.seen} == {"run-1/generator@7", "run-1/evaluator@7"}


@pytest.mark.parametrize(("problem", "rounds"), [(MATH, 3), (CODE, 2)])
async def test_eval_opt_never_exceeds_its_round_cap(problem, rounds) -> None:  # type: ignore[no-untyped-def]
    engine = eval_opt_script(["\\boxed{Incorrect}"] * 10)
    episode, final = await run_episode(make_task("eval_opt", problem=problem), engine)
    expected = [("generator", 0)]
    for r in range(rounds):
        expected += [("evaluator", r), ("generator", r + 1)]
    assert order(engine) == expected
    assert final == f"answer \\boxed{{{rounds + 3}}}"
    assert episode.facts["rounds_used"] == rounds
    assert episode.caps.rounds == rounds
    assert episode.caps.prompt_tokens == {"math": 30720, "code": 10240}[problem.task]


async def test_eval_opt_unparseable_verdict_counts_as_incorrect() -> None:
    engine = eval_opt_script(["looks fine to me", "\\boxed{maybe}", "\\boxed{Correct}"])
    episode, _ = await run_episode(make_task("eval_opt"), engine)
    assert order(engine)[-1] == ("evaluator", 2)
    assert len(engine.seen) == 6
    assert episode.facts["verdict_parse_rate"] == 1 / 3
    # unparseable = Incorrect, which is right about answers 3 and 4; Correct on 5 is right
    assert episode.facts["verdict_accuracy"] == 1.0


def test_verdict_parsing() -> None:
    assert verdict("ok \\boxed{Correct}") is True
    assert verdict("\\boxed{ incorrect. }") is False
    assert verdict("\\boxed{Correct} no wait \\boxed{Incorrect}") is False
    assert verdict("Correct") is None
    assert verdict("\\boxed{5}") is None


async def test_orch_workers_plan_then_three_workers_then_synthesizer() -> None:
    def script(role: str, slot: int, prompt: str) -> str:
        return {"orchestrator": "PLAN-XYZ", "worker": f"w{slot} \\boxed{{{5 if slot else 6}}}",
                "synthesizer": "final \\boxed{5}"}[role]

    engine = ScriptedEngine(script, delay_s=0.05)
    episode, final = await run_episode(make_task("orch_workers"), engine)
    assert order(engine)[0] == ("orchestrator", 0)
    assert sorted(order(engine)[1:4]) == [("worker", s) for s in range(3)]
    assert order(engine)[4] == ("synthesizer", 0)
    workers = engine.seen[1:4]
    assert max(w.started for w in workers) < min(w.ended for w in workers)
    assert all("PLAN-XYZ" in w.prompt for w in workers)
    assert all(f"w{s} \\boxed{{{5 if s else 6}}}" in engine.seen[4].prompt for s in range(3))
    assert [s.adapter for s in engine.seen] == [
        "run-1/orchestrator@7", *["run-1/worker@7"] * 3, "run-1/synthesizer@7"]
    assert final == "final \\boxed{5}"
    assert episode.facts == {"workers_oracle_pass_at_n": 1.0,
                             "synthesizer_agrees_with_majority": 1.0}
    assert episode.caps.prompt_tokens == 20480 and episode.caps.parallel == 3


def test_new_prompts_keep_the_task_answer_format() -> None:
    for problem, fmt in ((MATH, prompts.MATH_INSTRUCTION), (CODE, prompts.CODE_INSTRUCTION)):
        for messages in (prompts.generator(problem), prompts.reviser(problem, "a", "b"),
                         prompts.worker(problem, "p"), prompts.synthesizer(problem, ["x"])):
            assert messages[0]["content"].endswith(fmt)
        assert "\\boxed{Correct}" in prompts.evaluator(problem, "a")[0]["content"]


class ReverseFinishing(ScriptedEngine):
    """Slot 0 answers last: parallel generators finish in the reverse of their start order."""

    async def Generate(  # noqa: N802
        self, request: inference_pb2.GenerateRequest, timeout: float | None = None
    ) -> inference_pb2.GenerateResponse:
        slot = int(request.request_id.rsplit(":", 3)[2])
        await asyncio.sleep(0.03 * (3 - slot))
        return await super().Generate(request, timeout)


async def test_turns_are_recorded_in_start_order_whatever_order_they_finish() -> None:
    engine = ReverseFinishing(lambda role, slot, prompt: f"\\boxed{{{slot}}}")
    episode, _ = await run_episode(make_task("voting"), engine)
    # slot 2 got its answer first, slot 0 last
    assert [s.slot for s in sorted(engine.seen, key=lambda s: s.ended)][:3] == [2, 1, 0]
    # the record follows the start order, so equal rollouts train equally (the learner's
    # mini-batch shuffle is seeded over sequences in rollout order)
    assert [(t.role, t.slot) for t in episode.turns] == [
        ("generator", 0), ("generator", 1), ("generator", 2), ("aggregator", 0)
    ]
