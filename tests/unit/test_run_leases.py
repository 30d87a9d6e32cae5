"""Fenced leases on a real Redis: a take is exclusive and counts the run's fencing token,
renewal is a compare-and-set (also for a Redis user that may not run scripts), a learner
whose lease is taken stops the run at once and records nothing, and a checkpoint with an
older token than the one written beside the run's checkpoints is refused.

The run loop is the real one (`server.run_loop`); `HeldRun` (test_concurrent_run_loop)
stands in for the RunExecutor.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from marl.runtime import fences, streams
from marl.spec.services import LearnerConfig
from services.learner import lease as learner_lease
from services.learner import server
from services.learner.checkpoint import Checkpointer
from services.learner.runs import RunStore, run_key
from tests.support.batches import new_policy, spec
from tests.support.held_runs import HeldRun, state, submit, until

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("user", ["default", "noscript"])
async def test_a_take_is_exclusive_and_counts_the_fencing_token(
    redis_url: str, noscript_url: str, user: str
) -> None:
    r = streams.connect(redis_url if user == "default" else noscript_url)
    store = RunStore(r)
    try:
        await store.create("run", "", "/tmp/x", 1)
        takes = await asyncio.gather(*(store.claim("run", f"learner-{i}") for i in range(8)))
        won = [t for t in takes if t is not None]
        assert len(won) == 1 and won[0][1] == 1
        holder, _ = won[0]
        assert await store.renew("run", holder)
        assert await store.claim("run", "late") is None  # held: no take, no new token
        assert await fences.current(r, "run") == 1

        await r.delete(f"{run_key('run')}:lease")  # the holder stalled past its lease
        thief = await store.claim("run", "thief")
        assert thief is not None and thief[1] == 2
        assert not await store.renew("run", holder)  # the compare-and-set fails...
        assert await store.holds("run", thief[0])  # ...and leaves the new lease alone
        await store.release("run", holder)
        assert await store.holds("run", thief[0])
    finally:
        await r.aclose()


async def test_a_learner_whose_lease_is_taken_stops_the_run_and_records_nothing(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(learner_lease, "LEASE_S", 0.3)  # renew every 0.1 s
    HeldRun.started = {}
    monkeypatch.setattr(server, "RunExecutor", HeldRun)
    r = streams.connect(redis_url)
    store = RunStore(r)
    run_id = await submit(store, tmp_path, "a")
    loop = asyncio.create_task(server.run_loop(r, store, "learner-1", LearnerConfig()))
    try:
        await until(lambda: asyncio.sleep(0, run_id in HeldRun.started), "the run never started")
        held = HeldRun.started[run_id]
        assert held.kwargs["lease"].fence == 1
        await r.delete(f"{run_key(run_id)}:lease")
        thief = await store.claim(run_id, "learner-2")
        assert thief is not None and thief[1] == 2
        # the held run is cancelled, not finished: it never sees its end
        await until(lambda: asyncio.sleep(0, held.kwargs["lease"].lost is not None),
                    "the learner never found its lease lost")
        await asyncio.sleep(0.5)
        assert not held.end.done()
        assert await state(r, run_id) == "RUNNING"  # the new holder's to finish
        assert await store.holds(run_id, thief[0])
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await r.aclose()


def test_a_checkpoint_under_an_older_token_is_refused(model_dir: Path, tmp_path: Path) -> None:
    s = spec(mini_batch_size=4)
    policy = new_policy(model_dir, "shared", s)
    stale = Checkpointer(tmp_path, 1, 10, 3, fence=1)
    stale.claim()
    stale.save(1, policy, {"data_position": 1}, None)
    holder = Checkpointer(tmp_path, 1, 10, 3, fence=2)
    holder.claim()  # the new holder takes the run over
    with pytest.raises(fences.StaleFence, match="token 1 is stale"):
        stale.save(2, policy, {"data_position": 2}, None)
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text() == "step_000001"
    assert not (root / "step_000002").exists()
    with pytest.raises(fences.StaleFence):
        stale.claim()
    holder.save(2, policy, {"data_position": 2}, None)
    assert (root / "latest").read_text() == "step_000002"
