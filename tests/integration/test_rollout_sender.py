"""RolloutSender against a real redis-server: rollouts that finish together share one
MULTI/EXEC, each with its task's XACK, and a failed command fails its own rollout only."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis.asyncio as aioredis

from marl import streams
from marl.rollout import Rollout
from services.workflow.rollout_sender import RolloutSender


def rollout(run_id: str, k: int) -> Rollout:
    return Rollout(f"{run_id}:{k}", run_id, 0, "train", f"p{k}", 0, [], "", float(k % 2))


async def held_tasks(r: aioredis.Redis, n: int) -> list[str]:
    await streams.ensure_group(r, streams.TASKS, streams.WORKERS_GROUP)
    for k in range(n):
        await streams.add(r, streams.TASKS, {"k": k})
    got = await streams.read_group(
        r, streams.TASKS, streams.WORKERS_GROUP, "w1", count=n, block_ms=10
    )
    return [e.id for e in got]


async def exec_calls(r: aioredis.Redis) -> int:
    stats = await r.info("commandstats")
    return int(stats.get("cmdstat_exec", {}).get("calls", 0))


async def test_rollouts_finished_together_go_in_one_transaction(redis_url: str) -> None:
    r = streams.connect(redis_url)
    try:
        ids = await held_tasks(r, 40)
        sender = RolloutSender(r)
        before = await exec_calls(r)
        await asyncio.gather(*(sender.send(rollout("run-a", k), i) for k, i in enumerate(ids)))
        assert await exec_calls(r) - before == 1
        sent = await r.xrange(streams.rollouts_stream("run-a"))
        assert [Rollout.from_dict(json.loads(e["json"])).task_id for _, e in sent] == [
            f"run-a:{k}" for k in range(40)
        ]
        pending = await r.xpending(streams.TASKS, streams.WORKERS_GROUP)
        assert pending["pending"] == 0
        # one more after the first batch went: a transaction of its own
        more = await held_tasks(r, 1)
        await sender.send(rollout("run-a", 40), more[0])
        assert await exec_calls(r) - before == 2
    finally:
        await r.aclose()


async def test_a_failed_command_fails_only_its_own_rollout(redis_url: str) -> None:
    r = streams.connect(redis_url)
    try:
        ids = await held_tasks(r, 4)
        await r.set(streams.rollouts_stream("broken"), "not a stream")
        sender = RolloutSender(r)
        results = await asyncio.gather(
            sender.send(rollout("run-b", 0), ids[0]),
            sender.send(rollout("broken", 1), ids[1]),
            sender.send(rollout("run-b", 2), ids[2]),
            return_exceptions=True,
        )
        assert results[0] is None and results[2] is None
        assert "WRONGTYPE" in str(results[1])
        assert len(await r.xrange(streams.rollouts_stream("run-b"))) == 2
        with pytest.raises(Exception, match="WRONGTYPE"):
            await sender.send(rollout("broken", 3), ids[3])
        await sender.send(rollout("run-b", 3), ids[3])  # the sender goes on
        assert len(await r.xrange(streams.rollouts_stream("run-b"))) == 3
    finally:
        await r.aclose()
