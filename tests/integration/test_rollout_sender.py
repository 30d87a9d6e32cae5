"""RolloutSender against a real redis-server: rollouts that finish together share one
round trip, each with its task's XACK; a rollout whose task its run took back is not sent;
a failed command fails its own rollout only; and where Redis refuses scripts, a
MULTI/EXEC sends them, leaving out those of runs whose streams are gone."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis.asyncio as aioredis

from marl.rollout import Rollout
from marl.runtime import streams
from services.learner.episodes import LEARNER_GROUP
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


async def calls(r: aioredis.Redis, command: str) -> int:
    stats = await r.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


async def pending(r: aioredis.Redis) -> int:
    return int((await r.xpending(streams.TASKS, streams.WORKERS_GROUP))["pending"])


async def send_all(sender: RolloutSender, run_id: str, ids: list[str]) -> list[bool]:
    """One rollout of `run_id` per held task entry, sent at once."""
    return await asyncio.gather(*(sender.send(rollout(run_id, k), i) for k, i in enumerate(ids)))


async def sent_ids(r: aioredis.Redis, run_id: str) -> list[str]:
    sent = await r.xrange(streams.rollouts_stream(run_id))
    return [Rollout.from_dict(json.loads(e["json"])).task_id for _, e in sent]


async def test_rollouts_finished_together_go_in_one_round_trip(redis_url: str) -> None:
    r = streams.connect(redis_url)
    try:
        ids = await held_tasks(r, 40)
        sender = RolloutSender(r)
        before = await calls(r, "eval")
        got = await send_all(sender, "run-a", ids)
        assert got == [True] * 40
        assert await calls(r, "eval") - before == 1
        assert await sent_ids(r, "run-a") == [f"run-a:{k}" for k in range(40)]
        assert await pending(r) == 0
        # one more after the first batch went: a round trip of its own
        more = await held_tasks(r, 1)
        await sender.send(rollout("run-a", 40), more[0])
        assert await calls(r, "eval") - before == 2
    finally:
        await r.aclose()


async def test_a_rollout_of_a_task_its_run_took_back_is_acknowledged_not_sent(
    redis_url: str,
) -> None:
    r = streams.connect(redis_url)
    try:
        ids = await held_tasks(r, 3)
        await r.xdel(streams.TASKS, ids[1])  # as the learner withdraws a run's tasks
        sender = RolloutSender(r)
        got = await send_all(sender, "run-w", ids)
        assert got == [True, False, True]
        assert await sent_ids(r, "run-w") == ["run-w:0", "run-w:2"]
        assert await pending(r) == 0
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
        assert results[0] is True and results[2] is True
        assert "WRONGTYPE" in str(results[1])
        assert len(await r.xrange(streams.rollouts_stream("run-b"))) == 2
        assert await pending(r) == 2  # the failed one's task stays held, for a retry
        with pytest.raises(Exception, match="WRONGTYPE"):
            await sender.send(rollout("broken", 3), ids[3])
        await sender.send(rollout("run-b", 3), ids[3])  # the sender goes on
        assert len(await r.xrange(streams.rollouts_stream("run-b"))) == 3
        assert await pending(r) == 1
    finally:
        await r.aclose()


async def test_where_scripts_are_refused_a_transaction_sends_them(
    redis_url: str, noscript_url: str
) -> None:
    admin = streams.connect(redis_url)
    r = streams.connect(noscript_url)
    try:
        ids = await held_tasks(r, 3)
        await streams.ensure_group(r, streams.rollouts_stream("run-c"), LEARNER_GROUP)
        sender = RolloutSender(r)
        before = await calls(admin, "exec")
        got = await send_all(sender, "run-c", ids)
        assert got == [True] * 3
        assert await calls(admin, "exec") - before == 1
        assert await sent_ids(r, "run-c") == ["run-c:0", "run-c:1", "run-c:2"]
        assert await pending(r) == 0
    finally:
        await r.aclose()
        await admin.aclose()


async def test_where_scripts_are_refused_a_rollout_of_an_ended_run_is_acknowledged_not_sent(
    noscript_url: str,
) -> None:
    """The learner deletes its run's rollouts stream once the run has ended; a rollout
    finishing after that must not create the stream again, with nobody left to read it."""
    r = streams.connect(noscript_url)
    try:
        ids = await held_tasks(r, 3)
        await streams.ensure_group(r, streams.rollouts_stream("run-live"), LEARNER_GROUP)
        sender = RolloutSender(r)
        got = await asyncio.gather(
            sender.send(rollout("run-live", 0), ids[0]),
            sender.send(rollout("run-ended", 1), ids[1]),
            sender.send(rollout("run-live", 2), ids[2]),
        )
        assert got == [True, False, True]
        assert await r.exists(streams.rollouts_stream("run-ended")) == 0
        assert await sent_ids(r, "run-live") == ["run-live:0", "run-live:2"]
        assert await pending(r) == 0
    finally:
        await r.aclose()
