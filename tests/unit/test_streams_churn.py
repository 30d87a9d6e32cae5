"""Deliveries counted honestly, against a real redis-server: a task is dead-lettered for
failing, not for outliving its workers (issue 70). A delivery whose consumer died holding
the entry (its heartbeat lapsed) or handed it back is excused; a poison entry that kills
every consumer it reaches is dead-lettered after MAX_HOLDER_DEATHS deaths, and its
companions are spread so that they do not die with it."""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis

from marl.runtime import streams
from services.workflow import worker
from tests.support.worker_loop import working

S, G = "s", "g"
IDLE_MS = 20


async def hold(r: aioredis.Redis, consumer: str, count: int = 16) -> list[streams.Entry]:
    """`consumer` (alive for a moment) reads up to `count` new entries."""
    await streams.beat(r, consumer, ttl_s=0.05)
    return await streams.read_group(r, S, G, consumer, count=count, block_ms=10)


async def die_and_claim(
    r: aioredis.Redis, rescuer: str, told: list[streams.Entry], max_deliveries: int = 2
) -> list[streams.Entry]:
    """The holders' heartbeats lapse; `rescuer` takes over what they held."""
    await asyncio.sleep(0.1)

    async def on_dead(entry: streams.Entry) -> None:
        told.append(entry)

    await streams.beat(r, rescuer, ttl_s=0.05)  # alive while it claims, dead right after
    return await streams.claim_dead(
        r,
        S,
        G,
        rescuer,
        count=64,
        max_deliveries=max_deliveries,
        min_idle_ms=IDLE_MS,
        on_dead=on_dead,
    )


async def test_deliveries_to_workers_that_died_are_not_charged(redis_url: str) -> None:
    """Four holders die in turn (more than max_deliveries 2): the entry is never
    dead-lettered, Redis counts five deliveries, the entry is charged one."""
    r = streams.connect(redis_url)
    told: list[streams.Entry] = []
    try:
        await streams.ensure_group(r, S, G)
        await streams.add(r, S, {"i": 1})
        await hold(r, "w0")
        for n in range(1, streams.MAX_HOLDER_DEATHS):
            (entry,) = await die_and_claim(r, f"w{n}", told)
            assert (entry.deliveries, entry.charged, entry.holder_deaths) == (n + 1, 1, n)
        assert told == []
        assert await r.xlen(streams.dead_letter_stream(S)) == 0
    finally:
        await r.aclose()


async def test_a_poison_entry_is_dead_lettered_after_max_holder_deaths(redis_url: str) -> None:
    r = streams.connect(redis_url)
    told: list[streams.Entry] = []
    try:
        await streams.ensure_group(r, S, G)
        await streams.add(r, S, {"poison": True})
        await hold(r, "w0")
        for n in range(1, streams.MAX_HOLDER_DEATHS):
            assert len(await die_and_claim(r, f"w{n}", told, max_deliveries=100)) == 1
        assert await die_and_claim(r, "last", told, max_deliveries=100) == []
        (dead,) = told
        assert dead.data == {"poison": True}
        assert dead.holder_deaths == streams.MAX_HOLDER_DEATHS
        assert f"{streams.MAX_HOLDER_DEATHS} consumers died holding it" in dead.why_dead()
        records: Any = await r.xrange(streams.dead_letter_stream(S))
        (record,) = records
        assert record[1]["holder_deaths"] == str(streams.MAX_HOLDER_DEATHS)
        assert (await r.xpending(S, G))["pending"] == 0
        assert not await r.exists(streams.delivery_key(S, dead.id))
    finally:
        await r.aclose()


async def test_failures_still_count_between_deaths(redis_url: str) -> None:
    """A holder dies (excused), then the handler fails twice: with max_deliveries 2 the
    third charged delivery dead-letters it, as if no one had died."""
    r = streams.connect(redis_url)
    told: list[streams.Entry] = []
    try:
        await streams.ensure_group(r, S, G)
        await streams.add(r, S, {"i": 1})
        await hold(r, "w0")
        (entry,) = await die_and_claim(r, "w1", told)
        assert entry.charged == 1
        await streams.release(r, S, G, entry.id)  # its handler failed
        (entry,) = await die_and_claim(r, "w2", told)
        assert (entry.charged, entry.holder_deaths) == (2, 1)  # the retry consumer is no death
        await streams.release(r, S, G, entry.id)
        assert await die_and_claim(r, "w3", told) == []
        assert [e.charged for e in told] == [3]
    finally:
        await r.aclose()


async def test_companions_of_a_dead_holder_are_spread_one_suspect_per_claim(
    redis_url: str,
) -> None:
    """Four entries lose their first holder: taken together (no suspect yet). Their second
    holder dies too: now each is a suspect, and a claim takes one."""
    r = streams.connect(redis_url)
    told: list[streams.Entry] = []
    try:
        await streams.ensure_group(r, S, G)
        for i in range(4):
            await streams.add(r, S, {"i": i})
        assert len(await hold(r, "w0")) == 4
        assert len(await die_and_claim(r, "w1", told)) == 4
        taken = [await die_and_claim(r, f"w{n}", told) for n in range(2, 6)]
        assert [len(t) for t in taken] == [1, 1, 1, 1]
        assert sorted(t[0].data["i"] for t in taken) == [0, 1, 2, 3]
        # each lost two holders at most: none is near MAX_HOLDER_DEATHS
        assert max(t[0].holder_deaths for t in taken) <= 3
        assert told == []
    finally:
        await r.aclose()


async def test_handed_back_entries_are_not_charged_nor_a_death(redis_url: str) -> None:
    r = streams.connect(redis_url)
    told: list[streams.Entry] = []
    try:
        await streams.ensure_group(r, S, G)
        for i in range(3):
            await streams.add(r, S, {"i": i})
        await streams.beat(r, "stopping", ttl_s=30)  # alive: only a hand-back frees them
        assert len(await streams.read_group(r, S, G, "stopping", count=3, block_ms=10)) == 3
        assert await streams.hand_back(r, S, G, "stopping") == 3
        got = await die_and_claim(r, "next", told, max_deliveries=1)
        assert [(e.deliveries, e.charged, e.holder_deaths) for e in got] == [(2, 1, 0)] * 3
    finally:
        await r.aclose()


class SlowRunner(worker.EpisodeRunner):
    """Holds every task until cancelled."""

    async def run(self, task: Any) -> Any:
        await asyncio.Event().wait()


async def test_a_worker_stopping_hands_back_what_it_holds(redis_url: str) -> None:
    from tests.support.tasks import a_task

    r = streams.connect(redis_url)
    try:
        await streams.ensure_group(r, streams.TASKS, streams.WORKERS_GROUP)
        await streams.add(r, streams.TASKS, a_task().to_dict())
        async with working(SlowRunner(r, "w1", replica_wait_s=0, judge_endpoints=()), drain_s=0.1):
            for _ in range(200):
                if (await r.xpending(streams.TASKS, streams.WORKERS_GROUP))["pending"]:
                    break
                await asyncio.sleep(0.05)
        summary: Any = await r.xpending(streams.TASKS, streams.WORKERS_GROUP)
        assert {c["name"] for c in summary["consumers"]} == {streams.HANDBACK_CONSUMER}
    finally:
        await r.aclose()
