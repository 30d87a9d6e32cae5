"""Redis streams with consumer groups: the task, rollout and metric queues.

The pattern is XREADGROUP -> work -> XADD result -> XACK. A consumer proves it is
alive with a heartbeat key that expires by itself (`beat`); a consumer whose key
is gone is dead, and `claim_dead` hands its pending entries to a live consumer
within seconds, while a slow but live consumer keeps its entries however long
it works on them. `claim_stale` (XAUTOCLAIM) is the last resort for a consumer
that is alive but hung: entries idle longer than `claim_idle_s` move on. An
entry whose handler failed is `release`d to a pseudo-consumer nobody heartbeats
for, so it is retried after a short pause. Streams are never trimmed past
unacknowledged entries: producers apply backpressure by checking lag.

Dead-lettering counts deliveries honestly: an entry goes to a dead-letter stream for
failing, not for outliving its consumers. A delivery counts toward `max_deliveries`
when its handler failed (`release`) or hung (`claim_stale`); a delivery whose consumer
died holding it (`claim_dead` from a consumer whose heartbeat lapsed) or handed it back
on a clean stop (`hand_back`) is *excused*: Redis's own delivery counter counts it, the
entry's delivery record (`delivery_key`) subtracts it. So worker churn (pods killed,
scaled down, rescheduled) never dead-letters healthy work.

A poison entry, one that kills every consumer it reaches (a segfault, an OOM kill), is
still caught: each death of a consumer holding an entry counts in its record as a
`holder death`, and an entry whose holders died `MAX_HOLDER_DEATHS` times is
dead-lettered when the last death is noticed. The poison entry's companions (the other
entries those consumers held) count the same deaths, so once an entry has lost a holder
it is a *suspect*: `claim_dead` takes at most one suspect per call, which spreads
suspects over consumers and claims, and a companion then rarely shares another death
with the poison entry, while that one keeps killing whoever takes it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoPermissionError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger(__name__)

TASKS = "marl:tasks"
WORKERS_GROUP = "workers"
DEAD_LETTERED = "dead-lettered"
"""How the `error` of the rollout a dead-lettered task's run gets instead begins."""
RETRY_CONSUMER = "marl-retry"
"""Pseudo-consumer that holds released entries (whose handler failed) until one is claimed."""
HANDBACK_CONSUMER = "marl-handback"
"""Pseudo-consumer that holds the entries a consumer handed back on a clean stop: claimed at
once by another, the delivery excused."""
MAX_HOLDER_DEATHS = 5
"""Deaths of consumers holding one entry (heartbeat lapsed while it was pending with them)
after which the entry is dead-lettered as a poison entry: one that kills whatever runs it.
Under churn a healthy entry loses a holder rarely twice (suspects are spread, see above)."""
DEAD_LETTER_KEPT = 10_000
"""Entries a dead-letter stream keeps (about: trimmed as Redis finds cheapest), the newest;
nobody consumes it, so without a cap it would grow with every poison task for good."""
DELIVERY_RECORD_TTL_S = 7 * 24 * 3600
"""How long an entry's delivery record outlives its last excused delivery (it is deleted
when the entry is dead-lettered; one that finishes leaves it to expire)."""


def alive_key(consumer: str) -> str:
    return f"marl:alive:{consumer}"


def dead_letter_stream(stream: str) -> str:
    return f"{stream}:dead"


def rollouts_stream(run_id: str) -> str:
    return f"marl:rollouts:{run_id}"


def metrics_stream(run_id: str) -> str:
    return f"marl:metrics:{run_id}"


def connect(url: str, max_connections: int = 32) -> aioredis.Redis:
    """A client whose pool waits for a free connection instead of failing under load."""
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        decode_responses=True,
        max_connections=max_connections,
        timeout=60,
        # about 30 s of retries: a restarting Redis (a pod rescheduled, a crash with
        # AOF replay) is waited out instead of failing every caller
        retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=2.0), 20),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        health_check_interval=30,
        # a reply that never comes (a stalled server, a half-open connection) is an error
        # to retry, not a caller waiting forever; every blocking read here waits 500 ms
        socket_timeout=15,
        socket_connect_timeout=10,
    )
    return aioredis.Redis(connection_pool=pool)


@dataclass
class Entry:
    stream: str
    id: str
    data: dict[str, Any]
    deliveries: int = 1
    """Times delivered, this delivery included (Redis's counter)."""
    excused: int = 0
    """Of them, deliveries whose consumer died holding the entry or handed it back."""
    holder_deaths: int = 0
    """Consumers that died (heartbeat lapsed) holding the entry."""
    fields: dict[str, str] = field(default_factory=dict)
    """The entry as stored: its payload's bytes and signature (`marl.runtime.task_signing`)."""

    @property
    def charged(self) -> int:
        """Deliveries that count toward `max_deliveries`: the failed or hung ones, and this."""
        return self.deliveries - self.excused

    def why_dead(self) -> str:
        """Why it was dead-lettered, in words: its deliveries, and its holders' deaths."""
        why = f"after {self.deliveries} deliveries"
        if self.holder_deaths >= MAX_HOLDER_DEATHS:
            why += f": {self.holder_deaths} consumers died holding it (a poison entry?)"
        return why


def delivery_key(stream: str, entry_id: str) -> str:
    """The hash of an entry's excused deliveries and holder deaths (see the module doc)."""
    return f"{stream}:delivery:{entry_id}"


async def _delivery_records(
    r: aioredis.Redis, stream: str, entry_ids: list[str]
) -> dict[str, tuple[int, int]]:
    """entry id -> (excused deliveries, holder deaths) so far."""
    if not entry_ids:
        return {}
    async with r.pipeline(transaction=False) as pipe:
        for entry_id in entry_ids:
            pipe.hmget(delivery_key(stream, entry_id), ["excused", "deaths"])
        got = await pipe.execute()
    return {i: (int(e or 0), int(d or 0)) for i, (e, d) in zip(entry_ids, got, strict=True)}


async def _excuse(r: aioredis.Redis, stream: str, entry_ids: list[str], died: bool) -> None:
    """Count a delivery of each entry as excused (and, if `died`, a holder death)."""
    if not entry_ids:
        return
    async with r.pipeline(transaction=False) as pipe:
        for entry_id in entry_ids:
            key = delivery_key(stream, entry_id)
            pipe.hincrby(key, "excused", 1)
            if died:
                pipe.hincrby(key, "deaths", 1)
            pipe.expire(key, DELIVERY_RECORD_TTL_S)
        await pipe.execute()


async def ensure_group(r: aioredis.Redis, stream: str, group: str) -> bool:
    """Create `group` (and `stream`) unless it exists; True when it had to be created."""
    try:
        await r.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as err:
        if "BUSYGROUP" not in str(err):
            raise
        return False
    return True


def missing_group(err: ResponseError) -> bool:
    """Whether a stream command failed because its stream or group is gone (NOGROUP)."""
    return "NOGROUP" in str(err)


async def add(r: aioredis.Redis, stream: str, payload: dict[str, Any]) -> str:
    return str(await r.xadd(stream, {"json": json.dumps(payload)}))


async def add_many(r: aioredis.Redis, stream: str, payloads: list[dict[str, Any]]) -> None:
    async with r.pipeline(transaction=False) as pipe:
        for p in payloads:
            pipe.xadd(stream, {"json": json.dumps(p)})
        await pipe.execute()


def _decode(stream: str, entry_id: str, fields: dict[str, str]) -> Entry:
    """The entry; one whose payload is no JSON object (anyone can XADD) has empty `data`,
    which its consumer refuses, rather than failing the read that found it."""
    try:
        data = json.loads(fields["json"])
    except (KeyError, ValueError):
        data = None
    return Entry(stream, entry_id, data if isinstance(data, dict) else {}, fields=fields)


async def read_group(
    r: aioredis.Redis,
    stream: str,
    group: str,
    consumer: str,
    count: int = 16,
    block_ms: int = 1000,
) -> list[Entry]:
    """New entries for `consumer`; a stream or group that vanished (a Redis that lost its
    data, someone's DEL) is recreated and logged, and the read answers nothing this time."""
    try:
        resp: Any = await r.xreadgroup(
            group, consumer, {stream: ">"}, count=count, block=block_ms
        )
    except ResponseError as err:
        if not missing_group(err):
            raise
        if await ensure_group(r, stream, group):
            log.warning("stream %s had no group %s: recreated it", stream, group)
        return []
    out: list[Entry] = []
    for _name, entries in resp or []:
        for entry_id, fields in entries:
            if fields:
                out.append(_decode(stream, entry_id, fields))
    return out


async def ack(
    r: aioredis.Redis, stream: str, group: str, *ids: str, delete: bool = False
) -> None:
    """Acknowledge `ids`; with `delete`, also remove them from the stream (one round trip)."""
    if not ids:
        return
    if not delete:
        await r.xack(stream, group, *ids)
        return
    async with r.pipeline(transaction=False) as pipe:
        pipe.xack(stream, group, *ids)
        pipe.xdel(stream, *ids)
        await pipe.execute()


async def missing(r: aioredis.Redis, stream: str, entry_ids: list[str]) -> list[str]:
    """Those of `entry_ids` no longer in `stream`, in one round trip: its producer deletes an
    entry it no longer wants, even one a consumer holds pending."""
    async with r.pipeline(transaction=False) as pipe:
        for entry_id in entry_ids:
            pipe.xrange(stream, entry_id, entry_id, count=1)
        found = await pipe.execute()
    return [entry_id for entry_id, got in zip(entry_ids, found, strict=True) if not got]


async def beat(r: aioredis.Redis, consumer: str, ttl_s: float) -> None:
    """`consumer` is alive for the next `ttl_s` seconds."""
    await r.set(alive_key(consumer), "1", px=max(1, int(ttl_s * 1000)))


async def forget(r: aioredis.Redis, consumer: str) -> None:
    """`consumer` stops now: its pending entries are claimable at once."""
    await r.delete(alive_key(consumer))


async def release(r: aioredis.Redis, stream: str, group: str, entry_id: str) -> None:
    """Hand an entry whose handler failed to the retry pseudo-consumer (a consumer no one
    heartbeats for), so `claim_dead` retries it anywhere after its `min_idle_ms`. The
    delivery counts toward `max_deliveries`."""
    await r.xclaim(stream, group, RETRY_CONSUMER, min_idle_time=0, message_ids=[entry_id],
                   justid=True)


async def hand_back(r: aioredis.Redis, stream: str, group: str, consumer: str) -> int:
    """A consumer stopping cleanly hands back what it still holds: to the hand-back
    pseudo-consumer, claimable at once and with the delivery excused. How many."""
    pending: Any = await r.xpending_range(
        stream, group, min="-", max="+", count=10_000, consumername=consumer
    )
    ids = [p["message_id"] for p in pending]
    if not ids:
        return 0
    await _excuse(r, stream, ids, died=False)
    await r.xclaim(stream, group, HANDBACK_CONSUMER, min_idle_time=0, message_ids=ids,
                   justid=True)
    return len(ids)


DeadLetter = Callable[[Entry], Awaitable[None]]


async def _dead_letter(
    r: aioredis.Redis, stream: str, group: str, entry: Entry, on_dead: DeadLetter | None
) -> None:
    await r.xadd(
        dead_letter_stream(stream),
        {"json": json.dumps(entry.data), "source_id": entry.id, "deliveries": entry.deliveries,
         "excused": entry.excused, "holder_deaths": entry.holder_deaths},
        maxlen=DEAD_LETTER_KEPT, approximate=True,
    )
    if on_dead is not None:
        await on_dead(entry)
    await r.xack(stream, group, entry.id)
    await r.delete(delivery_key(stream, entry.id))


async def claim_dead(  # noqa: C901 (older than the limit; split it when next changed)
    r: aioredis.Redis,
    stream: str,
    group: str,
    consumer: str,
    count: int = 16,
    *,
    max_deliveries: int,
    min_idle_ms: int = 1000,
    on_dead: DeadLetter | None = None,
) -> list[Entry]:
    """Take over the pending entries of consumers whose heartbeat key expired.

    `min_idle_ms` keeps two claimers from taking one entry (XCLAIM resets the idle time,
    so the second finds it too fresh) and is the pause before a released entry is
    retried. An entry taken from a consumer that died has that delivery excused and one
    more holder death; at most one entry that had lost a holder before (a suspect) is
    taken per call. Entries charged more than `max_deliveries` deliveries, or whose
    holders died `MAX_HOLDER_DEATHS` times, are dead-lettered (`on_dead` runs first, e.g.
    to tell the producer) instead of returned (see the module doc).
    """
    try:
        summary: Any = await r.xpending(stream, group)
    except ResponseError as err:
        if missing_group(err):
            return []
        raise
    owners = [c["name"] for c in summary.get("consumers") or [] if c["name"] != consumer]
    if not owners:
        return []
    alive = await r.mget([alive_key(o) for o in owners])
    out: list[Entry] = []
    suspect_taken = False
    for owner, beating in zip(owners, alive, strict=True):
        if beating is not None or len(out) >= count:
            continue
        pending: Any = await r.xpending_range(
            stream, group, min="-", max="+", count=count - len(out), consumername=owner,
            idle=min_idle_ms,
        )
        if not pending:
            continue
        ids = [p["message_id"] for p in pending]
        records = await _delivery_records(r, stream, ids)
        suspects = [i for i in ids if records[i][1] > 0]
        if suspects:  # one suspect a call, spread over consumers (see the module doc)
            keep = set() if suspect_taken else {suspects[0]}
            ids = [i for i in ids if records[i][1] == 0 or i in keep]
            suspect_taken = suspect_taken or bool(keep)
        if not ids:
            continue
        deliveries = {p["message_id"]: int(p["times_delivered"]) + 1 for p in pending}
        claimed: Any = await r.xclaim(
            stream, group, consumer, min_idle_time=min_idle_ms, message_ids=ids
        )
        died = owner not in (RETRY_CONSUMER, HANDBACK_CONSUMER)
        if died:
            await _excuse(r, stream, [i for i, f in claimed if i is not None and f], died=True)
        got = {entry_id for entry_id, fields in claimed if entry_id is not None and fields}
        if len(got) < len(claimed):  # deleted entries (Redis < 7 keeps them pending)
            for entry_id in ids:
                if entry_id not in got and not await r.xrange(stream, entry_id, entry_id):
                    await r.xack(stream, group, entry_id)
        for entry_id, fields in claimed:
            if entry_id is None or not fields:
                continue
            entry = _decode(stream, entry_id, fields)
            entry.deliveries = deliveries[entry_id]
            excused, deaths = records[entry_id]
            entry.excused, entry.holder_deaths = excused + died, deaths + died
            log.info("claimed %s from dead consumer %s (delivery %d, %d excused, %d holder "
                     "deaths)", entry_id, owner, entry.deliveries, entry.excused,
                     entry.holder_deaths)
            if entry.charged > max_deliveries or entry.holder_deaths >= MAX_HOLDER_DEATHS:
                await _dead_letter(r, stream, group, entry, on_dead)
                continue
            out.append(entry)
    return out


async def forget_dead_consumers(
    r: aioredis.Redis, stream: str, group: str, min_idle_ms: int = 60_000
) -> int:
    """Remove consumers that hold nothing, read nothing for `min_idle_ms` and have no
    heartbeat (SIGKILLed workers), so the group does not grow without end."""
    try:
        consumers: Any = await r.xinfo_consumers(stream, group)
    except ResponseError:
        return 0
    gone = [
        c["name"]
        for c in consumers
        if int(c["pending"]) == 0 and int(c["idle"]) >= min_idle_ms
        and c["name"] != RETRY_CONSUMER
    ]
    if gone:
        beating = await r.mget([alive_key(n) for n in gone])
        gone = [n for n, b in zip(gone, beating, strict=True) if b is None]
    for name in gone:
        await r.xgroup_delconsumer(stream, group, name)
    return len(gone)


async def _group_info(r: aioredis.Redis, stream: str, group: str) -> dict[str, Any] | None:
    """XINFO GROUPS' entry for `group` of `stream`; None when either does not exist."""
    try:
        groups: Any = await r.xinfo_groups(stream)
    except ResponseError:
        return None
    return next((g for g in groups if g["name"] == group), None)


async def delete_matching(
    r: aioredis.Redis,
    stream: str,
    matches: Callable[[dict[str, Any]], bool],
    after: str | None = None,
    page: int = 1000,
) -> int:
    """Delete the entries of `stream` (those after id `after`, if given) whose payload
    `matches`, reading a page at a time. How many it deleted."""
    deleted, start = 0, "-" if after is None else f"({after}"
    while True:
        entries: Any = await r.xrange(stream, min=start, max="+", count=page)
        if not entries:
            return deleted
        doomed = [i for i, fields in entries if matches(_decode(stream, i, fields).data)]
        if doomed:
            deleted += int(await r.xdel(stream, *doomed))
        start = f"({entries[-1][0]}"


async def drop_undelivered(
    r: aioredis.Redis, stream: str, group: str, matches: Callable[[dict[str, Any]], bool]
) -> int:
    """Delete the entries no consumer of `group` has read yet whose payload `matches`: work
    that a process queued before it died, which its successor queues again (a SIGKILLed
    learner's tasks). Entries a consumer already holds are left to it. How many it deleted."""
    g = await _group_info(r, stream, group)
    if g is None:
        return 0
    return await delete_matching(r, stream, matches, after=g["last-delivered-id"])


async def claim_stale(
    r: aioredis.Redis,
    stream: str,
    group: str,
    consumer: str,
    min_idle_ms: int,
    count: int = 16,
    *,
    max_deliveries: int,
    on_dead: DeadLetter | None = None,
) -> list[Entry]:
    """Take over entries idle longer than `min_idle_ms` whoever holds them (a live but hung
    consumer's too); dead-letter the hopeless ones."""
    # Redis 6.2 answers [next, claimed]; 7.0+ adds the ids of deleted entries.
    reply = await r.xautoclaim(
        stream, group, consumer, min_idle_time=min_idle_ms, start_id="0-0", count=count
    )
    claimed = reply[1]
    if not claimed:
        return []
    pending = await r.xpending_range(
        stream, group, min=claimed[0][0], max=claimed[-1][0], count=len(claimed)
    )
    deliveries = {p["message_id"]: int(p["times_delivered"]) for p in pending}
    records = await _delivery_records(r, stream, [i for i, f in claimed if f])
    out: list[Entry] = []
    for entry_id, fields in claimed:
        if not fields:
            continue
        entry = _decode(stream, entry_id, fields)
        entry.deliveries = deliveries.get(entry_id, 1)
        entry.excused, entry.holder_deaths = records[entry_id]
        if entry.charged > max_deliveries:
            await _dead_letter(r, stream, group, entry, on_dead)
            continue
        out.append(entry)
    return out


@dataclass
class Backlog:
    """A consumer group's unfinished entries."""

    undelivered: int
    pending: int
    """Delivered to a consumer and not yet acknowledged."""
    consumers: int


async def backlog(r: aioredis.Redis, stream: str, group: str) -> Backlog | None:
    """`group`'s backlog on `stream`; None when either does not exist."""
    g = await _group_info(r, stream, group)
    if g is None:
        return None
    undelivered = g.get("lag")
    if undelivered is None:  # Redis < 7, or 7 with deleted entries not yet read past
        undelivered = await count_after(r, stream, g["last-delivered-id"])
    return Backlog(int(undelivered), int(g.get("pending") or 0), int(g.get("consumers") or 0))


async def lag(r: aioredis.Redis, stream: str, group: str) -> int:
    """Entries not yet delivered plus delivered-but-unacknowledged."""
    b = await backlog(r, stream, group)
    return 0 if b is None else b.undelivered + b.pending


COUNT_AFTER_SCRIPT = "return #redis.call('XRANGE', KEYS[1], ARGV[1], '+', 'COUNT', ARGV[2])"


COUNT_AFTER_LIMIT = 100_000
"""The most entries `count_after` counts."""


async def count_after(
    r: aioredis.Redis, stream: str, entry_id: str, limit: int = COUNT_AFTER_LIMIT
) -> int:
    """How many entries of `stream` come after `entry_id` (at most `limit`), counted inside
    Redis: reading them to count them moved every queued task's JSON to the caller, which
    the learner does before each batch of tasks it queues (`bench/stream_lag.py` measures
    the difference). Where scripts are refused (an ACL without EVAL), they are read and
    counted here."""
    start = f"({entry_id}"
    try:
        return int(await r.eval(COUNT_AFTER_SCRIPT, 1, stream, start, limit))
    except ResponseError as err:
        if not scripts_refused(err):
            raise
        entries: Any = await r.xrange(stream, min=start, count=limit)
        return len(entries)


def scripts_refused(err: ResponseError) -> bool:
    """Whether Redis refused to run scripts at all (an ACL without EVAL, a service that
    leaves the command out), rather than a command failing inside one."""
    return isinstance(err, NoPermissionError) or "unknown command" in str(err).lower()
