"""Training runs as records in Redis: queued by SubmitRun, taken by one learner at a time.

A learner training a run holds its lease (a Redis key with a time to live) and
renews it while it lives; a RUNNING run whose lease lapsed lost its learner and
is taken over, under the same run id, by the next learner that looks. Taking and
renewing a lease are each one compare-and-set (WATCH/MULTI/EXEC, which Redis users
that may not run scripts can send too), and each take counts the run's fencing token
up (`marl.runtime.fences`) in the same transaction; a learner that lost the lease
stops the run before its next push or checkpoint (services/learner/lease.py).

A finished run's Redis state (its record, acknowledgements, metrics stream and rollouts
stream: `run_keys`) expires `retention_s` after it ends (the learner config's
`retention_s`, a week by default; 0 keeps it), and `sweep` then drops the run from the
index and deletes any of its keys a late write recreated: Redis memory stays bounded
however many runs a deployment trains. The run directory on disk is not touched.

Every run records its owner, the user who submitted it (`marl.spec.users`); `scan`
walks the index oldest first, one owner's runs or all, for ListRuns' pages.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import WatchError

from marl.runtime import fences, streams
from marl.spec.users import ANONYMOUS_USER

QUEUE = "marl:runs:queue"
INDEX = "marl:runs"
EXPIRY = "marl:runs:expiry"
"""Finished runs -> the time their Redis state expires (`RunStore.finish`)."""
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
LEASE_S = 10.0
"""A learner that has not renewed its lease for this long is taken for dead."""
SCAN_BATCH = 256
"""Index entries `scan` reads from Redis at a time."""

Position = tuple[float, str]
"""A place in the index: (created_at, run id), the order runs are listed in."""


def owner_of(record: dict[str, Any]) -> str:
    """A run's owner; a run recorded before runs had owners is the anonymous user's."""
    return str(record.get("owner") or ANONYMOUS_USER)


def run_key(run_id: str) -> str:
    """The hash that is the run's record (state, step, counters such as dead_lettered,
    the newest fencing token)."""
    return fences.run_record_key(run_id)


_key = run_key


def _lease(run_id: str) -> str:
    return f"{run_key(run_id)}:lease"


def acks_key(run_id: str) -> str:
    """The hash of a run's acknowledged adapter pushes (services/learner/adapter_sync.py):
    `replica/policy@version` -> the time the replica took it."""
    return f"{run_key(run_id)}:acks"


def run_keys(run_id: str) -> list[str]:
    """Every Redis key that holds a run's state."""
    return [
        run_key(run_id),
        _lease(run_id),
        acks_key(run_id),
        streams.metrics_stream(run_id),
        streams.rollouts_stream(run_id),
    ]


def out_dir_key(out_dir: str) -> str:
    """The key naming the run that writes to `out_dir` (a resolved path): one run a
    directory, even before it has written anything there."""
    return f"marl:outdir:{hashlib.sha256(out_dir.encode()).hexdigest()}"


def new_run_id(name: str) -> str:
    return f"{name}-{secrets.token_hex(3)}"


class RunStore:
    def __init__(self, r: aioredis.Redis):
        self.r = r

    async def create(self, run_id: str, spec_yaml: str, out_dir: str, total_steps: int,
                     owner: str = ANONYMOUS_USER) -> None:
        now = time.time()
        await self.r.hset(
            _key(run_id),
            mapping={
                "run_id": run_id,
                "owner": owner,
                "state": "QUEUED",
                "spec_yaml": spec_yaml,
                "out_dir": out_dir,
                "step": 0,
                "total_steps": total_steps,
                "error": "",
                "last_metrics_json": "",
                "created_at": now,
                "cancel": 0,
            },
        )
        await self.r.zadd(INDEX, {run_id: now})
        await self.r.lpush(QUEUE, run_id)

    async def claim_out_dir(self, out_dir: str, run_id: str) -> str | None:
        """Make `run_id` the run that writes to `out_dir`: None, or the run that already
        does. A claim lasts until its run ends (`finish`); what the run wrote then marks
        the directory as a run's on disk."""
        key = out_dir_key(out_dir)
        if await self.r.set(key, run_id, nx=True):
            return None
        holder = await self.r.get(key)
        return str(holder) if holder is not None else await self.claim_out_dir(out_dir, run_id)

    async def release_out_dir(self, run_id: str) -> None:
        out_dir = await self.r.hget(_key(run_id), "out_dir")
        if out_dir and str(await self.r.get(out_dir_key(str(out_dir)))) == run_id:
            await self.r.delete(out_dir_key(str(out_dir)))

    async def get(self, run_id: str) -> dict[str, Any] | None:
        data: Any = await self.r.hgetall(_key(run_id))
        return data or None

    async def list(self) -> list[dict[str, Any]]:
        ids: Any = await self.r.zrange(INDEX, 0, -1)
        runs = [await self.get(i) for i in ids]
        return [r for r in runs if r]

    async def scan(self, after: Position | None = None, owner: str | None = None
                   ) -> AsyncIterator[tuple[Position, dict[str, Any]]]:
        """The runs after `after`, oldest first (equal times by run id, as Redis orders
        them), each with its position; only `owner`'s unless None. Reads the index a batch
        at a time, so a caller that stops early reads little."""
        passed = 0  # entries at `after`'s time already read and not after it
        while True:
            lo: float | str = "-inf" if after is None else after[0]
            batch: Any = await self.r.zrangebyscore(INDEX, lo, "+inf", start=passed,
                                                    num=SCAN_BATCH, withscores=True)
            fresh = [(float(s), str(m)) for m, s in batch
                     if after is None or (float(s), str(m)) > after]
            if not fresh:
                if len(batch) < SCAN_BATCH:
                    return
                passed += len(batch)
                continue
            passed = 0
            async with self.r.pipeline(transaction=False) as pipe:
                for _, run_id in fresh:
                    pipe.hget(_key(run_id), "owner")
                owners = await pipe.execute()
            for position, found in zip(fresh, owners, strict=True):
                after = position
                if owner is not None and str(found or ANONYMOUS_USER) != owner:
                    continue
                record = await self.get(position[1])
                if record is not None:  # forgotten since the index was read
                    yield position, record
            if len(batch) < SCAN_BATCH:
                return

    async def update(self, run_id: str, **fields: Any) -> None:
        clean: Any = {k: json.dumps(v) if isinstance(v, dict) else v for k, v in fields.items()}
        await self.r.hset(_key(run_id), mapping=clean)

    async def finish(self, run_id: str, state: str, retention_s: float, **fields: Any) -> None:
        """The run ends in `state` (one of TERMINAL); its Redis state expires after
        `retention_s` seconds (0: it is kept)."""
        assert state in TERMINAL
        now = time.time()
        await self.update(run_id, state=state, ended_at=now, **fields)
        await self.release_out_dir(run_id)
        if retention_s <= 0:
            return
        ttl_ms = max(1, int(retention_s * 1000))
        keys = run_keys(run_id)
        async with self.r.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.pttl(key)
            ttls = await pipe.execute()
        async with self.r.pipeline(transaction=False) as pipe:
            for key, ttl in zip(keys, ttls, strict=True):
                if ttl == -1 or ttl > ttl_ms:  # a shorter life of its own (acks) is kept
                    pipe.pexpire(key, ttl_ms)
            pipe.zadd(EXPIRY, {run_id: now + retention_s})
            await pipe.execute()

    async def sweep(self, now: float | None = None) -> int:
        """Forget the finished runs whose retention has passed: their index entries, and
        their keys (expired already, unless a late write recreated one). How many."""
        due: Any = await self.r.zrangebyscore(EXPIRY, "-inf", time.time() if now is None else now)
        if not due:
            return 0
        async with self.r.pipeline(transaction=False) as pipe:
            for run_id in due:
                pipe.delete(*run_keys(run_id))
            pipe.zrem(INDEX, *due)
            pipe.zrem(EXPIRY, *due)
            await pipe.execute()
        return len(due)

    async def take_next(self, timeout_s: float = 1.0) -> str | None:
        item = await self.r.brpop([QUEUE], timeout=timeout_s)
        return None if item is None else str(item[1])

    async def request_cancel(self, run_id: str) -> None:
        await self.r.hset(_key(run_id), "cancel", 1)

    async def cancel_requested(self, run_id: str) -> bool:
        return str(await self.r.hget(_key(run_id), "cancel")) == "1"

    async def claim(self, run_id: str, learner_id: str) -> tuple[str, int] | None:
        """Take the run's lease if no live learner holds it: (the lease's holder string,
        its fencing token), or None. One transaction: of two learners that see the lease
        lapsed, one takes it, and the token counts up with the take."""
        lease = _lease(run_id)
        holder = f"{learner_id}:{secrets.token_hex(4)}"
        async with self.r.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(lease)
                if await pipe.exists(lease):
                    return None
                pipe.multi()
                pipe.set(lease, holder, px=int(LEASE_S * 1000))
                pipe.hincrby(_key(run_id), fences.FIELD, 1)
                _, fence = await pipe.execute()
            except WatchError:
                return None
        return holder, int(fence)

    async def renew(self, run_id: str, holder: str) -> bool:
        """Extend the lease `holder` (what `claim` returned) holds; False if it holds it no more.
        A compare-and-set: the lease is extended only while it still names `holder`."""
        lease = _lease(run_id)
        async with self.r.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(lease)
                if str(await pipe.get(lease)) != holder:
                    return False
                pipe.multi()
                pipe.pexpire(lease, int(LEASE_S * 1000))
                await pipe.execute()
            except WatchError:  # the lease changed between the read and the write
                return False
        return True

    async def holds(self, run_id: str, holder: str) -> bool:
        """Whether the run's lease is `holder`'s now."""
        return str(await self.r.get(_lease(run_id))) == holder

    async def release(self, run_id: str, holder: str) -> None:
        """Drop the lease if it is still `holder`'s (a compare-and-delete)."""
        lease = _lease(run_id)
        async with self.r.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(lease)
                if str(await pipe.get(lease)) != holder:
                    return
                pipe.multi()
                pipe.delete(lease)
                await pipe.execute()
            except WatchError:
                return

    async def orphaned(self) -> builtins.list[str]:
        """RUNNING runs whose learner's lease lapsed, oldest first."""
        ids: Any = await self.r.zrange(INDEX, 0, -1)
        out = []
        for run_id in ids:
            state = await self.r.hget(_key(run_id), "state")
            if str(state) == "RUNNING" and not await self.r.exists(_lease(run_id)):
                out.append(str(run_id))
        return out

    async def count_takeover(self, run_id: str) -> int:
        """How many times this run has been taken over, this one included."""
        return int(await self.r.hincrby(_key(run_id), "takeovers", 1))
