"""Continuous batching in the transformers engine: a request that arrives while a batch
runs joins it at the next step and leaves when done, and no row's tokens depend on
what else shares its batch."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from services.inference.engine import GenerationRequest, GenerationResult
from services.inference.transformers_engine import BASE, TransformersEngine


def request(seed: int, max_tokens: int, prompt: list[int] | None = None) -> GenerationRequest:
    return GenerationRequest(
        prompt or [5, 6, 7], BASE, max_tokens=max_tokens, temperature=1.0, seed=seed
    )


def test_a_late_request_joins_the_running_batch_and_leaves_first(model_dir: Path) -> None:
    engine = TransformersEngine(str(model_dir))
    long_req = request(seed=7, max_tokens=60)
    short_req = request(seed=4, max_tokens=3, prompt=[8, 9, 10, 11, 12, 13, 14])

    async def run() -> tuple[GenerationResult, GenerationResult, float, float]:
        finished: dict[str, float] = {}

        async def timed(name: str, req: GenerationRequest) -> GenerationResult:
            out = await engine.generate(req)
            finished[name] = time.perf_counter()
            return out

        first = asyncio.create_task(timed("long", long_req))
        await asyncio.sleep(0.03)  # the long request's batch is decoding by now
        second = asyncio.create_task(timed("short", short_req))
        a, b = await asyncio.gather(first, second)
        return a, b, finished["long"], finished["short"]

    async def separately() -> list[GenerationResult]:
        return [await engine.generate(long_req), await engine.generate(short_req)]

    async def both() -> tuple[tuple[GenerationResult, GenerationResult, float, float],
                              list[GenerationResult]]:
        try:
            return await run(), await separately()
        finally:
            await engine.close()

    (joined_long, joined_short, t_long, t_short), (solo_long, solo_short) = asyncio.run(both())
    assert len(solo_long.token_ids) == 60, "the long request must not stop early"
    assert t_short < t_long, "the late request waited for the running batch to end"
    for joined, solo in ((joined_long, solo_long), (joined_short, solo_short)):
        assert joined.token_ids == solo.token_ids
        assert joined.logprobs == pytest.approx(solo.logprobs, abs=1e-4)
        assert joined.finish_reason == solo.finish_reason


def test_rows_of_different_lengths_in_one_batch_match_each_alone(model_dir: Path) -> None:
    engine = TransformersEngine(str(model_dir))
    reqs = [request(seed=s, max_tokens=n, prompt=[5] * (1 + s)) for s, n in
            ((1, 2), (2, 9), (3, 5), (4, 1), (5, 12))]

    async def together() -> list[GenerationResult]:
        return list(await asyncio.gather(*(engine.generate(r) for r in reqs)))

    async def each() -> list[GenerationResult]:
        return [await engine.generate(r) for r in reqs]

    async def both() -> tuple[list[GenerationResult], list[GenerationResult]]:
        try:
            return await together(), await each()
        finally:
            await engine.close()

    batched, solo = asyncio.run(both())
    for b, s in zip(batched, solo, strict=True):
        assert b.token_ids == s.token_ids
        assert b.logprobs == pytest.approx(s.logprobs, abs=1e-4)
