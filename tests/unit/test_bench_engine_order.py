"""bench/e2e.py's engine alone in the workflow's order: an episode's stages and their replay
(each stage asked for once the one before it is answered, every episode at once)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import e2e

from marl.models.demo import demo_model_dir
from services.inference.engine import GenerationRequest


def turn(role: str, slot: int, prompt: list[int]) -> dict[str, Any]:
    return {"role": role, "slot": slot, "prompt_ids": prompt}


VOTING = [turn("generator", 0, [5]), turn("generator", 1, [6]), turn("generator", 2, [7]),
          turn("aggregator", 0, [8])]
EVAL_OPT = [turn("generator", 0, [5]), turn("evaluator", 0, [6]), turn("generator", 1, [7]),
            turn("evaluator", 1, [8]), turn("generator", 2, [9])]


def slots(stages: list[list[dict[str, Any]]]) -> list[list[tuple[str, int]]]:
    return [[(t["role"], t["slot"]) for t in stage] for stage in stages]


def test_voting_asks_for_its_generators_at_once_then_its_aggregator() -> None:
    assert slots(e2e.stages(VOTING)) == [
        [("generator", 0), ("generator", 1), ("generator", 2)], [("aggregator", 0)]
    ]


def test_eval_opt_rounds_are_one_turn_a_stage() -> None:
    assert [len(s) for s in e2e.stages(EVAL_OPT)] == [1, 1, 1, 1, 1]


def test_single_is_one_stage() -> None:
    assert slots(e2e.stages([turn("solver", 0, [5])])) == [[("solver", 0)]]


def test_replay_waits_for_a_stage_before_the_next_and_runs_episodes_together() -> None:
    """A fake engine logs when each prompt starts and ends: every episode's first stage
    starts before any request ends, and an aggregator starts only after its own three
    generators ended."""
    log: list[tuple[str, int]] = []

    async def generate(request: GenerationRequest) -> Any:
        prompt = request.prompt_token_ids[0]
        log.append(("start", prompt))
        await asyncio.sleep(0.001 * (prompt % 10))
        log.append(("end", prompt))
        return SimpleNamespace(token_ids=[0] * (prompt % 10 + 1))

    def request(t: dict[str, Any]) -> GenerationRequest:
        return GenerationRequest(t["prompt_ids"], "x@0", 4)

    def shifted(turns: list[dict[str, Any]], by: int) -> list[dict[str, Any]]:
        return [{**t, "prompt_ids": [t["prompt_ids"][0] + by]} for t in turns]

    episodes = [shifted(VOTING, 0), shifted(VOTING, 10)]
    tokens = asyncio.run(e2e.in_workflow_order(generate, episodes, request))

    assert tokens == sum(p % 10 + 1 for p in (5, 6, 7, 8, 15, 16, 17, 18))
    first_end = next(i for i, (what, _) in enumerate(log) if what == "end")
    assert {p for what, p in log[:first_end]} == {5, 6, 7, 15, 16, 17}
    for generators, aggregator in (((5, 6, 7), 8), ((15, 16, 17), 18)):
        started = log.index(("start", aggregator))
        assert all(log.index(("end", g)) < started for g in generators)


def test_replay_on_the_real_engine_counts_what_it_generated() -> None:
    """The transformers engine on the demo model: Voting-shaped episodes through it in the
    workflow's order; the count is the tokens the engine returned."""
    from marl.spec.services import InferenceConfig
    from services.inference.transformers_engine import BASE, TransformersEngine

    engine = TransformersEngine(InferenceConfig(model=str(demo_model_dir())), batch_wait_s=0.005)
    returned: list[int] = []

    async def generate(request: GenerationRequest) -> Any:
        result = await engine.generate(request)
        returned.append(len(result.token_ids))
        return result

    def request(t: dict[str, Any]) -> GenerationRequest:
        return GenerationRequest(t["prompt_ids"], BASE, 4, seed=t["prompt_ids"][0])

    async def run() -> int:
        try:
            episodes = [[{**t, "prompt_ids": [5, 6, 7 + k]} for t in VOTING] for k in range(3)]
            return await e2e.in_workflow_order(generate, episodes, request)
        finally:
            await engine.close()

    tokens = asyncio.run(run())
    assert len(returned) == 12
    assert tokens == sum(returned) > 0
