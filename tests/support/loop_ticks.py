"""Counting event-loop turns beside an await: a loop that keeps ticking while work runs was
not blocked by it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class Ticks:
    count = 0


@asynccontextmanager
async def loop_ticks(every_s: float) -> AsyncIterator[Ticks]:
    """Yields a counter that a task beside the block bumps every `every_s` seconds."""
    ticks = Ticks()

    async def tick() -> None:
        while True:
            await asyncio.sleep(every_s)
            ticks.count += 1

    ticking = asyncio.create_task(tick())
    try:
        yield ticks
    finally:
        ticking.cancel()
