"""The workers' scrape hook exports Redis's memory and its maxmemory, read from a real
redis-server, so an alert can fire before a noeviction Redis starts refusing writes."""

from __future__ import annotations

from prometheus_client import REGISTRY

from marl.runtime import streams
from marl.runtime.prometheus_metrics import redis_memory_hook


async def test_the_hook_exports_used_and_max_memory(redis_url: str) -> None:
    r = streams.connect(redis_url)
    try:
        await r.config_set("maxmemory", str(64 * 1024 * 1024))
        await r.set("filler", "x" * 100_000)
        await redis_memory_hook(r)()
        used = REGISTRY.get_sample_value("marl_redis_memory_used_bytes")
        assert REGISTRY.get_sample_value("marl_redis_memory_max_bytes") == 64 * 1024 * 1024
        assert used is not None and 100_000 < used < 64 * 1024 * 1024
    finally:
        await r.aclose()
