"""Retention (issue 70): a finished run's Redis state expires, and Redis memory stays bounded
over many runs. 200 short runs go through the learner's own run loop (`run_loop`: queue,
lease, finish) against a real redis-server, each writing what a run writes to Redis through
the same code (the run record and metrics stream sinks, the rollouts stream, adapter acks);
only the training is left out. After the retention every key they made is gone and Redis's
memory is back within a set bound of where it started."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from marl.runtime import streams
from marl.spec.run import RunSpec, dump_spec
from marl.spec.services import LearnerConfig
from services.learner import server
from services.learner.runs import (
    EXPIRY,
    INDEX,
    TERMINAL,
    RunStore,
    acks_key,
    run_key,
    run_keys,
)
from services.learner.sinks import RunRecordSink, StreamSink

RUNS = 200
STEPS = 3
ROLLOUT = {"turns": [{"completion_ids": list(range(200))}], "final_text": "x" * 500}
RETENTION_S = 10.0
"""Longer than the last ten runs take, shorter than all 200."""
MEMORY_BOUND = 256 * 1024
"""Bytes of used_memory 200 forgotten runs may leave behind (allocator slack)."""


class ShortRun:
    """A RunExecutor that trains nothing: it writes a short run's Redis state the way a run
    does (its records through RunRecordSink and StreamSink, rollouts as the workers send
    them, the adapter acks), then ends as its spec's name says."""

    def __init__(
        self,
        run_id: str,
        spec: RunSpec,
        out_dir: Path,
        r: aioredis.Redis,
        store: RunStore,
        *args: Any,
        **kwargs: Any,
    ):
        self.run_id, self.spec, self.r, self.store = run_id, spec, r, store

    async def execute(self) -> None:
        sinks: list[Any] = [RunRecordSink(self.store, self.run_id), StreamSink(self.r, self.run_id)]
        rollouts = streams.rollouts_stream(self.run_id)
        await streams.ensure_group(self.r, rollouts, "learner")
        for step in range(1, STEPS + 1):
            ids = [await streams.add(self.r, rollouts, ROLLOUT) for _ in range(4)]
            # the learner reads them, and acknowledges and deletes all but a late one
            await streams.ack(self.r, rollouts, "learner", *ids[:-1], delete=True)
            await self.r.hset(acks_key(self.run_id), f"i0/shared@{step}", time.time())
            record = {
                "step": step,
                "train/reward_mean": 0.5,
                "train/episodes": 4,
                "train/episode_errors": 0,
                "train/failed_step": 0,
                "alarms": [],
            }
            for sink in sinks:
                await sink.write(step, record)
        if self.spec.name.startswith("failing"):
            raise server.RunFailed("planted")


async def used_memory(r: aioredis.Redis) -> int:
    info: Any = await r.info("memory")
    return int(info["used_memory"])


async def run_many(
    r: aioredis.Redis,
    store: RunStore,
    names: list[str],
    retention_s: float,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> list[str]:
    """Submit runs named `names` as SubmitRun does, train them through `run_loop`, return
    their ids once every one has ended."""
    monkeypatch.setattr(server, "RunExecutor", ShortRun)
    ids = []
    for n, name in enumerate(names):
        spec = RunSpec.model_validate({"name": name, "logging": {"tensorboard": False}})
        run_id = f"{name}-{n:04d}"
        await store.create(run_id, dump_spec(spec), str(tmp_path / run_id), STEPS)
        ids.append(run_id)
    loop = asyncio.create_task(server.run_loop(r, store, "learner-t", LearnerConfig(retention_s=retention_s)))
    ended: set[str] = set()
    try:
        deadline = time.monotonic() + 400
        while len(ended) < len(ids):
            assert time.monotonic() < deadline, f"{len(ids) - len(ended)} runs still going"
            assert not loop.done(), loop.exception()
            await asyncio.sleep(0.5)
            async with r.pipeline(transaction=False) as pipe:
                for run_id in ids:
                    pipe.hget(run_key(run_id), "state")
                states = await pipe.execute()
            # a run whose retention passed already has no record: it ended too
            ended |= {
                i
                for i, s in zip(ids, states, strict=True)
                if s in TERMINAL or (s is None and await r.zscore(EXPIRY, i) is not None)
            }
        return ids
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)


@pytest.mark.slow
async def test_200_finished_runs_leave_redis_memory_bounded_after_retention(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    r = streams.connect(redis_url)
    store = RunStore(r)
    try:
        keys_before = await r.dbsize()
        memory_before = await used_memory(r)
        names = [("failing" if n % 10 == 0 else "short") for n in range(RUNS)]
        ids = await run_many(r, store, names, RETENTION_S, monkeypatch, tmp_path)
        keys_full, memory_full = await r.dbsize(), await used_memory(r)
        assert keys_full > keys_before + 20  # the newest runs' state, not yet expired

        last, failing = ids[-1], ids[-10]
        assert (await store.get(last) or {}).get("state") == "SUCCEEDED"
        assert (await store.get(last) or {}).get("steps_done") == str(STEPS)
        assert (await store.get(failing) or {}).get("state") == "FAILED"
        for key in run_keys(last):
            if await r.exists(key):
                assert 0 < await r.pttl(key) <= RETENTION_S * 1000, key
        assert await r.ttl(acks_key(last)) <= RETENTION_S  # a shorter life of its own stays
        # the oldest run's keys expire by themselves, before any sweep
        first_due = await r.zscore(EXPIRY, ids[0])
        await asyncio.sleep(max(0.0, float(first_due) - time.time()) + 0.5)
        assert not any([await r.exists(k) for k in run_keys(ids[0])])

        expires: Any = await r.zrange(EXPIRY, -1, -1, withscores=True)
        await asyncio.sleep(max(0.0, expires[0][1] - time.time()) + 0.5)
        assert await store.sweep() == RUNS
        assert await store.list() == []
        assert not await r.exists(INDEX) and not await r.exists(EXPIRY)
        left = [k for k in await r.keys("*")]
        assert await r.dbsize() <= keys_before, left
        grown = await used_memory(r) - memory_before
        print(
            f"used_memory: before {memory_before}, with {RUNS} runs {memory_full}, "
            f"after retention {memory_before + grown}"
        )
        assert grown < MEMORY_BOUND, f"{grown} bytes left after {RUNS} runs expired"
    finally:
        await r.aclose()


async def test_retention_zero_keeps_a_finished_run(
    redis_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    r = streams.connect(redis_url)
    store = RunStore(r)
    try:
        (run_id,) = await run_many(r, store, ["short"], 0, monkeypatch, tmp_path)
        assert await r.ttl(run_keys(run_id)[0]) == -1
        assert await r.ttl(streams.metrics_stream(run_id)) == -1
        assert await store.sweep(now=time.time() + 10**9) == 0
        assert [x["run_id"] for x in await store.list()] == [run_id]
    finally:
        await r.aclose()


async def test_a_cancelled_queued_run_expires_too(redis_url: str, tmp_path: Path) -> None:
    from unittest.mock import AsyncMock

    from marl.protocol.v1 import learner_pb2

    r = streams.connect(redis_url)
    store = RunStore(r)
    try:
        await store.create("q-1", "{}", str(tmp_path), 1)
        service = server.LearnerService(r, store, tmp_path, retention_s=60)
        run = await service.CancelRun(learner_pb2.CancelRunRequest(run_id="q-1"), AsyncMock())
        assert run.state == "CANCELLED"
        assert 0 < await r.ttl(run_keys("q-1")[0]) <= 60
        assert await store.sweep(now=time.time() + 61) == 1
        assert await store.get("q-1") is None
    finally:
        await r.aclose()


async def test_one_run_a_directory_until_it_ends(redis_url: str) -> None:
    """`claim_out_dir`: a second run cannot take a directory a queued or running run
    writes to; once that run ends the claim goes with it (what it wrote marks the
    directory from then on, services/learner/intake.py)."""
    r = streams.connect(redis_url)
    store = RunStore(r)
    try:
        await store.create("a-1", "", "/runs/x", 1)
        assert await store.claim_out_dir("/runs/x", "a-1") is None
        assert await store.claim_out_dir("/runs/x", "b-2") == "a-1"
        assert await store.claim_out_dir("/runs/y", "b-2") is None
        await store.finish("a-1", "CANCELLED", retention_s=60)
        assert await store.claim_out_dir("/runs/x", "c-3") is None
        await store.finish("a-1", "CANCELLED", retention_s=60)  # ended already: c-3 keeps it
        assert await store.claim_out_dir("/runs/x", "d-4") == "c-3"
    finally:
        await r.aclose()
