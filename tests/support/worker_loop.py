"""A worker's task loop running for the length of a test's block."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from marl.runtime.task_signing import TaskSigner
from marl.spec.services import WorkflowConfig
from services.workflow import worker


@asynccontextmanager
async def working(
    runner: worker.EpisodeRunner, signer: TaskSigner | None = None, **options: Any
) -> AsyncIterator[asyncio.Task[None]]:
    """`worker.work_loop(runner, ...)` (4 at once, a 2 s heartbeat unless `options` say
    otherwise; checking tasks with `signer`) until the block ends; then it is cancelled
    and `runner` closed."""
    loop = asyncio.create_task(
        worker.work_loop(
            runner, WorkflowConfig(**{"concurrency": 4, "heartbeat_ttl_s": 2.0, **options}),
            signer=signer,
        )
    )
    try:
        yield loop
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await runner.close()
