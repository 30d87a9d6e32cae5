"""Rollout fan-out and collection: a step's tasks go to the workers' stream, rollouts come back.

Task ids are deterministic (run, kind, step, problem, sample), so a rollout that
arrives twice (a worker died after sending it but before acknowledging its task,
and another ran the task again), or one left over from a learner that died, is
counted once; the run's record counts the duplicates dropped and the tasks that
were dead-lettered. A step adds its tasks only while fewer than
`max_queued_tasks` wait in the tasks stream (undelivered or unacknowledged), so
a lagging fleet of workers slows producers down instead of growing the queue.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from marl import streams
from marl.config import RunSpec
from marl.data.problem import Problem
from marl.rollout import AdapterRef, Rollout, Task
from services.learner.errors import RunFailed
from services.learner.runs import run_key

log = logging.getLogger(__name__)

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
        max_queued_tasks: int = 4096,
    ):
        self.run_id = run_id
        self.spec = spec
        self.r = r
        self.consumer = consumer
        self.adapters = adapters
        """Role -> the adapter version its turns must use now."""
        self.check_cancel = check_cancel
        self.stream = streams.rollouts_stream(run_id)
        self.max_queued_tasks = max_queued_tasks

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
        ids: list[str] = []
        try:
            got = await self.collect({t.id: t for t in tasks}, list(tasks), ids)
        finally:
            # every one of these has its rollout (or this run is over): safe to delete
            if ids:
                await self.r.xdel(streams.TASKS, *ids)
        return [got[t.id] for t in tasks]

    async def add_tasks(self, queue: list[Task], ids: list[str]) -> None:
        """Move tasks from `queue` to the tasks stream while the stream has room."""
        if not queue:
            return
        room = self.max_queued_tasks - await streams.lag(
            self.r, streams.TASKS, streams.WORKERS_GROUP
        )
        batch, queue[:] = queue[: max(room, 0)], queue[max(room, 0) :]
        if not batch:
            return
        async with self.r.pipeline(transaction=False) as pipe:
            for t in batch:
                pipe.xadd(streams.TASKS, {"json": json.dumps(t.to_dict())})
            ids.extend(await pipe.execute())

    async def collect(
        self,
        expected: dict[str, Task],
        queue: list[Task] | None = None,
        ids: list[str] | None = None,
    ) -> dict[str, Rollout]:
        """The rollouts of `expected` (task id -> task), adding the tasks of `queue` as the
        tasks stream has room (their entry ids go to `ids`); a rollout served by another
        adapter version than its task names (left over from a learner that died) is
        dropped."""
        got: dict[str, Rollout] = {}
        deadline = time.monotonic() + self.spec.train.step_timeout_s
        queue = [] if queue is None else queue
        ids = [] if ids is None else ids
        while len(got) < len(expected):
            try:
                await self.add_tasks(queue, ids)
                entries = await streams.read_group(
                    self.r, self.stream, LEARNER_GROUP, self.consumer, count=1024, block_ms=500
                )
            except (RedisConnectionError, RedisTimeoutError) as err:
                # Redis is down past the client's own retries: wait it out within the
                # step's deadline (AOF brings back what it had acknowledged)
                log.warning("redis unreachable while collecting rollouts: %s; retrying", err)
                if time.monotonic() > deadline:
                    raise RunFailed(f"redis unreachable for the whole step: {err}") from err
                await asyncio.sleep(1.0)
                continue
            for e in entries:
                rollout = Rollout.from_dict(e.data)
                task = expected.get(rollout.task_id)
                if task is None or not _current(rollout, task):
                    continue
                if rollout.task_id in got:
                    log.info("dropped a second rollout of task %s", rollout.task_id)
                    await self.r.hincrby(run_key(self.run_id), "duplicate_rollouts", 1)
                    continue
                got[rollout.task_id] = rollout
                if (rollout.error or "").startswith(streams.DEAD_LETTERED):
                    await self.r.hincrby(run_key(self.run_id), "dead_lettered", 1)
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
