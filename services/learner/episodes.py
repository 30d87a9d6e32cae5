"""Rollout fan-out and collection: a step's tasks go to the workers' stream, rollouts come back.

Task ids are deterministic (run, kind, step, problem, sample), so a rollout that
arrives twice, or one left over from a learner that died, is counted once.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis

from marl import streams
from marl.config import RunSpec
from marl.data.problem import Problem
from marl.rollout import AdapterRef, Rollout, Task
from services.learner.errors import RunFailed

LEARNER_GROUP = "learner"


class Episodes:
    def __init__(
        self,
        run_id: str,
        spec: RunSpec,
        r: aioredis.Redis,
        consumer: str,
        adapters: Callable[[], dict[str, AdapterRef]],
        check_cancel: Callable[[], Awaitable[None]],
    ):
        self.run_id = run_id
        self.spec = spec
        self.r = r
        self.consumer = consumer
        self.adapters = adapters
        """Role -> the adapter version its turns must use now."""
        self.check_cancel = check_cancel
        self.stream = streams.rollouts_stream(run_id)

    async def open(self, fresh: bool) -> None:
        """Create the streams' groups; `fresh` drops rollouts a previous learner of this run
        left behind (a taken-over run re-runs its step with new adapter versions)."""
        if fresh:
            await self.r.delete(self.stream)
        await streams.ensure_group(self.r, self.stream, LEARNER_GROUP)
        await streams.ensure_group(self.r, streams.TASKS, streams.WORKERS_GROUP)

    def make_task(self, problem: Problem, step: int, kind: str, sample: int) -> Task:
        return Task.for_spec(
            self.spec, self.run_id, problem, step, kind, sample, self.adapters()  # type: ignore[arg-type]
        )

    async def run(self, problems: list[Problem], step: int, kind: str) -> list[Rollout]:
        """Every problem group_size times (train) or once (val); the rollouts in task order."""
        n = self.spec.grpo.group_size if kind == "train" else 1
        tasks = [self.make_task(p, step, kind, s) for p in problems for s in range(n)]
        async with self.r.pipeline(transaction=False) as pipe:
            for t in tasks:
                pipe.xadd(streams.TASKS, {"json": json.dumps(t.to_dict())})
            ids = await pipe.execute()
        try:
            got = await self.collect({t.id: t for t in tasks})
        finally:
            # every one of these was acknowledged (or this run is over): safe to delete
            await self.r.xdel(streams.TASKS, *ids)
        return [got[t.id] for t in tasks]

    async def collect(self, expected: dict[str, Task]) -> dict[str, Rollout]:
        """The rollouts of `expected` (task id -> task); one served by another adapter
        version than its task names (left over from a learner that died) is dropped."""
        got: dict[str, Rollout] = {}
        deadline = time.monotonic() + self.spec.train.step_timeout_s
        while len(got) < len(expected):
            entries = await streams.read_group(
                self.r, self.stream, LEARNER_GROUP, self.consumer, count=1024, block_ms=500
            )
            for e in entries:
                rollout = Rollout.from_dict(e.data)
                task = expected.get(rollout.task_id)
                if task is not None and rollout.task_id not in got and _current(rollout, task):
                    got[rollout.task_id] = rollout
            if entries:
                await streams.ack(self.r, self.stream, LEARNER_GROUP, *[e.id for e in entries])
                await self.r.xdel(self.stream, *[e.id for e in entries])
            else:
                await self.check_cancel()
            if time.monotonic() > deadline:
                raise RunFailed(
                    f"only {len(got)}/{len(expected)} rollouts arrived within "
                    f"train.step_timeout_s={self.spec.train.step_timeout_s:.0f}s; "
                    "are workflow workers running?"
                )
        return got


def _current(rollout: Rollout, task: Task) -> bool:
    return all(
        t.adapter.version == task.adapters[t.role].version
        for t in rollout.turns
        if t.role in task.adapters
    )
