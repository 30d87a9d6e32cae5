"""A RunExecutor that trains until a test lets it end, and the run-queue helpers the
learner's run-loop tests poll with: the queue, leases and records stay the real code's."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from marl.spec.run import RunSpec, dump_spec
from services.learner import server
from services.learner.runs import RunStore, run_key


class HeldRun:
    """A RunExecutor that trains until the test lets it end: `finish` ends it as it would
    (SUCCEEDED, or a crash), a cancel of its run ends it CANCELLED."""

    started: dict[str, HeldRun] = {}

    def __init__(self, run_id: str, spec: RunSpec, out_dir: Path, r: aioredis.Redis,
                 store: RunStore, *args: Any, **kwargs: Any):  # fmt: skip
        self.run_id, self.store, self.kwargs = run_id, store, kwargs
        self.end: asyncio.Future[Exception | None] = asyncio.get_running_loop().create_future()

    async def execute(self) -> None:
        HeldRun.started[self.run_id] = self
        while not self.end.done():
            if await self.store.cancel_requested(self.run_id):
                raise server.RunCancelled()
            await asyncio.sleep(0.05)
        error = self.end.result()
        if error is not None:
            raise error

    def finish(self, error: Exception | None = None) -> None:
        self.end.set_result(error)


async def submit(store: RunStore, tmp_path: Path, name: str) -> str:
    spec = RunSpec.model_validate({"name": name, "logging": {"tensorboard": False}})
    await store.create(name, dump_spec(spec), str(tmp_path / name), 1)
    return name


async def state(r: aioredis.Redis, run_id: str) -> str:
    return str(await r.hget(run_key(run_id), "state"))


async def until(check: Any, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


async def states_become(r: aioredis.Redis, expected: dict[str, str]) -> None:
    async def check() -> bool:
        return all([await state(r, i) == s for i, s in expected.items()])

    await until(check, f"states did not become {expected}")


async def executing(held: dict[str, HeldRun], *run_ids: str) -> None:
    """A run's state turns RUNNING before its executor starts: wait for the executor."""
    await until(lambda: asyncio.sleep(0, all(i in held for i in run_ids)), f"{run_ids} not started")
