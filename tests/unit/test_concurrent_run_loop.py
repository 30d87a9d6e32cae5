"""The learner's run loop with `learner.max_concurrent_runs` (issue 70): up to N runs train
at once, each in a task of its own, and one run's cancel or crash leaves the others
running; with 1 (the default) runs go one after another. The training is left out (a
`HeldRun` stands in for RunExecutor); the queue, leases and records are the real code's on
a real redis-server. `RunLane`: runs interleaved on one torch thread draw the random
numbers each draws alone."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from marl.runtime import streams
from marl.runtime.torch_thread import TorchThread
from marl.spec.services import LearnerConfig
from services.learner import server
from services.learner.run_lane import RunLane
from services.learner.runs import RunStore, run_key
from tests.support.held_runs import HeldRun, executing, state, states_become, submit, until

pytestmark = pytest.mark.timeout(120)


@pytest.fixture()
def held(monkeypatch: pytest.MonkeyPatch) -> dict[str, HeldRun]:
    HeldRun.started = {}
    monkeypatch.setattr(server, "RunExecutor", HeldRun)
    return HeldRun.started


async def test_two_runs_at_once_one_cancelled_one_crashed_the_others_go_on(
    redis_url: str, tmp_path: Path, held: dict[str, HeldRun]
) -> None:
    r = streams.connect(redis_url)
    store = RunStore(r)
    a, b, c = [await submit(store, tmp_path, n) for n in ("a", "b", "c")]
    cfg = LearnerConfig(max_concurrent_runs=2, burst_threads=4)
    loop = asyncio.create_task(server.run_loop(r, store, "learner-t", cfg))
    try:
        await states_become(r, {a: "RUNNING", b: "RUNNING"})
        await executing(held, a, b)
        await asyncio.sleep(1.5)  # more than a queue poll: c waits for a free slot
        assert await state(r, c) == "QUEUED" and c not in held
        # each run its own lane of one torch thread, and no burst: the cores are shared
        lanes = [held[i].kwargs["torch_thread"] for i in (a, b)]
        assert all(isinstance(x, RunLane) for x in lanes) and lanes[0] is not lanes[1]
        assert lanes[0].thread is lanes[1].thread
        assert [held[i].kwargs["learner"].burst_threads for i in (a, b)] == [0, 0]

        await store.request_cancel(a)
        await states_become(r, {a: "CANCELLED", b: "RUNNING", c: "RUNNING"})
        assert not held[b].end.done()
        await executing(held, c)
        held[c].finish(RuntimeError("planted crash"))
        await states_become(r, {c: "FAILED", b: "RUNNING"})
        assert "planted crash" in str(await r.hget(run_key(c), "error"))
        held[b].finish()
        await states_become(r, {b: "SUCCEEDED"})
        assert not loop.done()

        async def released() -> bool:  # after its end is recorded, each run's lease goes
            return not await r.exists(*(f"{run_key(i)}:lease" for i in (a, b, c)))

        await until(released, "a lease was kept")
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await r.aclose()


async def test_one_run_at_a_time_by_default(
    redis_url: str, tmp_path: Path, held: dict[str, HeldRun]
) -> None:
    r = streams.connect(redis_url)
    store = RunStore(r)
    a, b = [await submit(store, tmp_path, n) for n in ("a", "b")]
    loop = asyncio.create_task(server.run_loop(r, store, "learner-t", LearnerConfig()))
    try:
        await states_become(r, {a: "RUNNING"})
        await asyncio.sleep(1.5)
        assert await state(r, b) == "QUEUED" and b not in held
        await executing(held, a)
        held[a].finish()
        await states_become(r, {a: "SUCCEEDED", b: "RUNNING"})
        await executing(held, b)
        held[b].finish()
        await states_become(r, {b: "SUCCEEDED"})
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await r.aclose()


async def test_a_learner_stopped_mid_runs_releases_every_lease(
    redis_url: str, tmp_path: Path, held: dict[str, HeldRun]
) -> None:
    """SIGTERM: the loop is cancelled; its runs stay RUNNING with their leases released,
    for another learner to take over."""
    r = streams.connect(redis_url)
    store = RunStore(r)
    a, b = [await submit(store, tmp_path, n) for n in ("a", "b")]
    cfg = LearnerConfig(max_concurrent_runs=2)
    loop = asyncio.create_task(server.run_loop(r, store, "learner-t", cfg))
    try:
        await executing(held, a, b)
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
    assert sorted(await store.orphaned()) == [a, b]
    await r.aclose()


async def test_learner_replicas_each_take_runs_from_the_one_queue(
    redis_url: str, tmp_path: Path, held: dict[str, HeldRun]
) -> None:
    """Two learners (the chart's `learner.replicas`) on one Redis, one run at a time each:
    each takes one of the two queued runs, under its own lease."""
    r = streams.connect(redis_url)
    store = RunStore(r)
    a, b = [await submit(store, tmp_path, n) for n in ("a", "b")]
    loops = [
        asyncio.create_task(server.run_loop(r, store, learner, LearnerConfig()))
        for learner in ("learner-1", "learner-2")
    ]
    try:
        await states_become(r, {a: "RUNNING", b: "RUNNING"})
        holders = {str(await r.get(f"{run_key(i)}:lease")).split(":")[0] for i in (a, b)}
        assert holders == {"learner-1", "learner-2"}
        await executing(held, a, b)
        for run in held.values():
            run.finish()
        await states_become(r, {a: "SUCCEEDED", b: "SUCCEEDED"})
    finally:
        for loop in loops:
            loop.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        await r.aclose()


def seed_both(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)


def draw() -> tuple[list[float], float]:
    return torch.rand(3).tolist(), random.random()


async def test_runs_on_one_torch_thread_draw_what_each_draws_alone() -> None:
    thread = TorchThread("test")
    try:
        alone: dict[int, list[Any]] = {}
        for seed in (1, 2):
            lane = RunLane(thread)
            await lane.run(seed_both, seed)
            alone[seed] = [await lane.run(draw) for _ in range(4)]
        assert alone[1] != alone[2]
        one, two = RunLane(thread), RunLane(thread)
        await one.run(seed_both, 1)
        await two.run(seed_both, 2)
        got: dict[int, list[Any]] = {1: [], 2: []}
        for _ in range(4):
            for seed, lane in ((1, one), (2, two)):
                got[seed].append(await lane.run(draw))
                seed_both(99)  # the process's generators move between a run's calls too
        assert got == alone
        # without lanes the second seed wins: the first run draws the second's numbers
        await thread.run(seed_both, 1)
        await thread.run(seed_both, 2)
        assert await thread.run(draw) == alone[2][0] != alone[1][0]
    finally:
        thread.close()
