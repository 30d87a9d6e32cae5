"""Service replicas announce themselves in Redis and keep a heartbeat; learners
publish the adapter versions a replica must hold before it serves.

Each replica is one Redis key that expires by itself `MAX_AGE_S` after its last
heartbeat, so a SIGKILLed replica leaves nothing behind; readers also skip an
entry older than their `max_age_s`. An
inference replica announces itself as soon as its engine is loaded, first as
*joining* (`"serving": false`): the learner pushes adapters to every live
inference replica, joining ones included, but workers route requests only to
serving ones. A joining replica turns serving once it holds every *current*
adapter: the newest version of each adapter an active run uses, which that
run's learner records in `CURRENT_ADAPTERS` (name, version, base model; never
the weights) and refreshes while the run lasts. An entry whose learner stopped
refreshing it (a crashed learner) expires after `max_age_s`, so it cannot keep
new replicas out of service.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from marl.runtime.aio_tasks import raise_if_cancelled

HEARTBEAT_S = 2.0
MAX_AGE_S = 10.0
CURRENT_ADAPTERS = "marl:adapters:current"


def registry_key(kind: str) -> str:
    """Prefix of the `kind` replicas' keys (one key per replica)."""
    return f"marl:replicas:{kind}"


def replica_key(kind: str, replica_id: str) -> str:
    return f"{registry_key(kind)}:{replica_id}"


async def announce(r: aioredis.Redis, kind: str, replica_id: str, info: dict[str, Any]) -> None:
    await r.set(
        replica_key(kind, replica_id),
        json.dumps({**info, "ts": time.time()}),
        px=int(MAX_AGE_S * 1000),
    )


async def withdraw(r: aioredis.Redis, kind: str, replica_id: str, timeout_s: float = 2.0) -> None:
    """Remove the replica's key at once; where Redis does not answer within `timeout_s`,
    leave it to expire by itself (a stopping replica must not wait out a Redis outage)."""
    with contextlib.suppress(TimeoutError, RedisError, OSError):
        await asyncio.wait_for(r.delete(replica_key(kind, replica_id)), timeout_s)


async def heartbeat(r: aioredis.Redis, kind: str, replica_id: str, info: dict[str, Any]) -> None:
    """Re-announce every HEARTBEAT_S; a Redis outage (a restart) is waited out."""
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    try:
        while True:
            try:
                await announce(r, kind, replica_id, info)
            except (RedisConnectionError, RedisTimeoutError, OSError):
                pass  # the key expires meanwhile; the next beat restores it
            raise_if_cancelled()
            await asyncio.sleep(HEARTBEAT_S)
    finally:
        await withdraw(r, kind, replica_id)


async def live(
    r: aioredis.Redis, kind: str, max_age_s: float = MAX_AGE_S, include_joining: bool = False
) -> dict[str, dict[str, Any]]:
    """Replicas with a fresh heartbeat; joining ones (not yet serving) only if asked for."""
    now = time.time()
    out: dict[str, dict[str, Any]] = {}
    prefix = registry_key(kind) + ":"
    keys = [k async for k in r.scan_iter(match=prefix + "*", count=1000)]
    values: Any = await r.mget(keys) if keys else []
    for key, raw in zip(keys, values, strict=True):
        if raw is None:  # expired between SCAN and MGET
            continue
        rid = key[len(prefix) :]
        info = json.loads(raw)
        if now - float(info["ts"]) <= max_age_s and (include_joining or info.get("serving", True)):
            out[rid] = info
    return out


async def publish_current(
    r: aioredis.Redis, base_model: str, run_id: str, versions: dict[str, int], owner: str = ""
) -> None:
    """Record (or refresh) adapter name -> version as what every replica must hold;
    `owner`: the user whose run pushes them."""
    now = time.time()
    mapping: Any = {
        name: json.dumps({"version": v, "base_model": base_model, "run_id": run_id,
                          "owner": owner, "ts": now})
        for name, v in versions.items()
    }
    if mapping:
        await r.hset(CURRENT_ADAPTERS, mapping=mapping)


async def retire_current(r: aioredis.Redis, names: list[str]) -> None:
    if names:
        await r.hdel(CURRENT_ADAPTERS, *names)


async def published(
    r: aioredis.Redis, name: str, base_model: str, owner: str | None, max_age_s: float = MAX_AGE_S
) -> int | None:
    """The version of adapter `name` its run's learner published last for replicas of
    `base_model` (None: none, an entry too old, or, for a request made for user `owner`,
    another user's)."""
    raw = await r.hget(CURRENT_ADAPTERS, name)
    if raw is None:
        return None
    info = json.loads(raw)
    if info["base_model"] != base_model or time.time() - float(info["ts"]) > max_age_s:
        return None
    if owner is not None and info.get("owner", "") != owner:
        return None
    return int(info["version"])


async def current(
    r: aioredis.Redis, base_model: str, max_age_s: float = MAX_AGE_S
) -> dict[str, int]:
    """Adapter name -> version a replica of `base_model` must hold before it serves."""
    now = time.time()
    out: dict[str, int] = {}
    entries: Any = await r.hgetall(CURRENT_ADAPTERS)
    for name, raw in entries.items():
        info = json.loads(raw)
        if info["base_model"] == base_model and now - float(info["ts"]) <= max_age_s:
            out[name] = int(info["version"])
    return out
