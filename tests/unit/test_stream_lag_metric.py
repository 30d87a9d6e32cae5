"""`marl_stream_lag` on /metrics: what a consumer group has not acknowledged yet, read from
a real Redis when Prometheus scrapes (undelivered and pending entries both count)."""

from __future__ import annotations

import asyncio

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from marl.runtime import streams
from marl.runtime.http_server import HttpServer
from marl.runtime.prometheus_metrics import on_scrape, stream_lag_hook

STREAM, GROUP = "marl:test-lag", "lag-workers"


async def scrape_lag(address: str) -> float | None:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://{address}/metrics") as reply:
            assert reply.status == 200
            text = await reply.text()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "marl_stream_lag" and s.labels == {"stream": STREAM, "group": GROUP}:
                return float(s.value)
    return None


def test_stream_lag_counts_undelivered_and_pending_entries(redis_url: str) -> None:
    async def go() -> list[float | None]:
        r = streams.connect(redis_url)
        http = HttpServer("127.0.0.1", 0)

        async def broken() -> None:
            raise ConnectionError("redis is down")

        on_scrape(http.app, broken)  # a failing hook does not fail the scrape
        on_scrape(http.app, stream_lag_hook(r, STREAM, GROUP))
        await http.start()
        seen = []
        try:
            seen.append(await scrape_lag(http.address))  # no stream yet
            await streams.ensure_group(r, STREAM, GROUP)
            for n in range(3):
                await r.xadd(STREAM, {"json": str(n)})
            seen.append(await scrape_lag(http.address))  # 3 undelivered
            got = await r.xreadgroup(GROUP, "c1", {STREAM: ">"}, count=2)
            seen.append(await scrape_lag(http.address))  # 1 undelivered + 2 pending
            ids = [eid for _, entries in got for eid, _ in entries]
            await r.xack(STREAM, GROUP, *ids)
            seen.append(await scrape_lag(http.address))  # 1 undelivered
        finally:
            await http.stop()
            await r.aclose()
        return seen

    assert asyncio.run(go()) == [0.0, 3.0, 3.0, 1.0]
