"""Service replicas announce themselves in Redis and keep a heartbeat; learners
publish the adapter versions a replica must hold before it serves.

A replica is live while its last heartbeat is younger than `max_age_s`. An
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
import json
import time
from typing import Any

import redis.asyncio as aioredis

HEARTBEAT_S = 2.0
MAX_AGE_S = 10.0
CURRENT_ADAPTERS = "marl:adapters:current"


def registry_key(kind: str) -> str:
    return f"marl:replicas:{kind}"


async def announce(r: aioredis.Redis, kind: str, replica_id: str, info: dict[str, Any]) -> None:
    await r.hset(registry_key(kind), replica_id, json.dumps({**info, "ts": time.time()}))


async def heartbeat(r: aioredis.Redis, kind: str, replica_id: str, info: dict[str, Any]) -> None:
    try:
        while True:
            await announce(r, kind, replica_id, info)
            await asyncio.sleep(HEARTBEAT_S)
    finally:
        await r.hdel(registry_key(kind), replica_id)


async def live(
    r: aioredis.Redis, kind: str, max_age_s: float = MAX_AGE_S, include_joining: bool = False
) -> dict[str, dict[str, Any]]:
    """Replicas with a fresh heartbeat; joining ones (not yet serving) only if asked for."""
    now = time.time()
    out: dict[str, dict[str, Any]] = {}
    entries: Any = await r.hgetall(registry_key(kind))
    for rid, raw in entries.items():
        info = json.loads(raw)
        if now - float(info["ts"]) <= max_age_s and (include_joining or info.get("serving", True)):
            out[rid] = info
    return out


async def publish_current(
    r: aioredis.Redis, base_model: str, run_id: str, versions: dict[str, int]
) -> None:
    """Record (or refresh) adapter name -> version as what every replica must hold."""
    now = time.time()
    mapping: Any = {
        name: json.dumps({"version": v, "base_model": base_model, "run_id": run_id, "ts": now})
        for name, v in versions.items()
    }
    if mapping:
        await r.hset(CURRENT_ADAPTERS, mapping=mapping)


async def retire_current(r: aioredis.Redis, names: list[str]) -> None:
    if names:
        await r.hdel(CURRENT_ADAPTERS, *names)


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
