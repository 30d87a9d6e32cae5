"""Rollout fan-out and collection: a step's tasks go to the workers' stream, rollouts come back.

Task ids are deterministic (run, kind, step, problem, sample), so a rollout that
arrives twice (a worker died after sending it but before acknowledging its task,
and another ran the task again), or one left over from a learner that died, is
counted once; the run's record counts the duplicates dropped and the tasks that
were dead-lettered. A step adds its tasks only while fewer than
`max_queued_tasks` wait in the tasks stream (undelivered or unacknowledged), so
a lagging fleet of workers slows producers down instead of growing the queue.

Submitting and gathering are apart (`submit`, `gather`), so the learner can keep later
steps' tasks queued while it trains (`train.max_staleness`); rollouts are kept by task
until their own step gathers them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from marl.problem import Problem
from marl.rollout import AdapterRef, Rollout, Task
from marl.runtime import streams, tracing
from marl.runtime.task_signing import TaskSigner
from marl.spec.run import RunSpec
from services.learner.errors import RunFailed
from services.learner.runs import run_key

log = logging.getLogger(__name__)

LEARNER_GROUP = "learner"


@dataclass
class Pending:
    """One submission's tasks and the stream entries of those added so far."""

    tasks: list[Task]
    ids: list[str] = field(default_factory=list)
    after: asyncio.Event | None = None
    """Set once the adapter versions the tasks name are on the replicas: until then they
    wait in the learner's queue (None: they are already)."""

    released: float | None = None
    """time.monotonic() when its first tasks set off for the stream (None: not yet)."""

    def ready(self) -> bool:
        return self.after is None or self.after.is_set()


class Episodes:
    def __init__(
        self,
        run_id: str,
        spec: RunSpec,
        r: aioredis.Redis,
        consumer: str,
        adapters: Callable[[], dict[str, AdapterRef]],
        check_cancel: Callable[[], Awaitable[None]],
        max_queued_tasks: int,
        signer: TaskSigner | None = None,
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
        self.signer = signer or TaskSigner(None)
        """Signs each task queued (workers run only tasks signed with the services' token)."""
        self.queue: list[tuple[Task, Pending]] = []
        """Submitted tasks not yet in the tasks stream, in submission order."""
        self.expected: dict[str, Task] = {}
        """Every submitted task not yet gathered, by id."""
        self.arrived: dict[str, Rollout] = {}
        """Rollouts of `expected` tasks read so far."""
        self._adding = asyncio.Lock()

    async def open(self, fresh: bool) -> None:
        """Create the streams' groups; `fresh` drops rollouts a previous learner of this run
        left behind (a taken-over run re-runs its step with new adapter versions), and its
        tasks no worker has read yet (a step's, and those of the steps queued ahead): left
        queued, they would keep the workers generating rollouts that are dropped on
        arrival before they reach the resumed step's tasks."""
        if fresh:
            await self.r.delete(self.stream)
            dropped = await streams.drop_undelivered(
                self.r, streams.TASKS, streams.WORKERS_GROUP,
                lambda task: task.get("run_id") == self.run_id,
            )
            if dropped:
                log.info("dropped %d tasks a previous learner of %s queued", dropped, self.run_id)
        await streams.ensure_group(self.r, self.stream, LEARNER_GROUP)
        await streams.ensure_group(self.r, streams.TASKS, streams.WORKERS_GROUP)

    async def close(self) -> None:
        """Delete the run's rollouts stream and its group once the run has ended (every
        submission is withdrawn by then, so no worker sends to it again): left behind, each
        finished run kept an empty stream in Redis. A learner that takes a run over starts
        its stream afresh anyway (`open`). Best effort, as `withdraw` is."""
        try:
            await self.r.delete(self.stream)
        except (RedisConnectionError, RedisTimeoutError) as err:
            log.warning("could not delete the rollouts stream of %s: %s", self.run_id, err)

    def make_task(self, problem: Problem, step: int, kind: str, sample: int) -> Task:
        return Task.for_spec(
            self.spec,
            self.run_id,
            problem,
            step=step,
            kind=kind,  # type: ignore[arg-type]
            sample=sample,
            adapters=self.adapters(),
        )

    def submit(
        self,
        problems: list[Problem],
        step: int,
        kind: str,
        after: asyncio.Event | None = None,
        samples: int | None = None,
    ) -> Pending:
        """Queue every problem group_size times (train) or once (val; `samples` times when
        given: pass@k) with the adapter versions current now; the tasks reach the stream as
        it has room (and once `after` is set), while any earlier submission is gathered."""
        n = samples or (self.spec.grpo.group_size if kind == "train" else 1)
        pending = Pending(
            [self.make_task(p, step, kind, s) for p in problems for s in range(n)], after=after
        )
        for t in pending.tasks:
            self.expected[t.id] = t
            self.queue.append((t, pending))
        return pending

    async def gather(self, pending: Pending) -> list[Rollout]:
        """The rollouts of a submission, in task order. Rollouts of later submissions that
        arrive meanwhile are kept for their own gather. Queued tasks of later submissions
        reach the stream first, even when every rollout of this one is in already: the
        workers then generate them while the learner trains on this one."""
        try:
            await self.collect({t.id for t in pending.tasks})
            return [self.arrived.pop(t.id) for t in pending.tasks]
        finally:
            # every one of these has its rollout (or this run is over): safe to delete
            await self.withdraw(pending)

    async def withdraw(self, pending: Pending) -> None:
        """Drop a submission from the learner's books and its tasks from the learner's queue
        and the tasks stream: once it is gathered, or when it will not be (its run ended
        first), so that no worker that has not read them yet generates rollouts nobody reads
        (one that has finishes its episode). Deleting is best effort: a stream entry left
        behind by a Redis outage costs memory, not correctness."""
        self.queue[:] = [q for q in self.queue if q[1] is not pending]
        for t in pending.tasks:
            self.expected.pop(t.id, None)
            self.arrived.pop(t.id, None)
        if pending.ids:
            try:
                await self.r.xdel(streams.TASKS, *pending.ids)
            except (RedisConnectionError, RedisTimeoutError) as err:
                log.warning("could not take back %d queued tasks: %s", len(pending.ids), err)

    async def run(
        self, problems: list[Problem], step: int, kind: str, samples: int | None = None
    ) -> list[Rollout]:
        """Submit and gather at once: the rollouts in task order."""
        return await self.gather(self.submit(problems, step, kind, samples=samples))

    async def add_tasks(self) -> None:
        """Move queued tasks whose adapter versions are out to the tasks stream, in order,
        while the stream has room."""
        async with self._adding:  # the collector and a push that just landed may both call
            await self._add_tasks()

    async def _add_tasks(self) -> None:
        if not self.queue or not self.queue[0][1].ready():
            return
        room = self.max_queued_tasks - await streams.lag(
            self.r, streams.TASKS, streams.WORKERS_GROUP
        )
        ready = next((k for k, (_, p) in enumerate(self.queue) if not p.ready()), len(self.queue))
        take = min(max(room, 0), ready)
        batch, self.queue[:] = self.queue[:take], self.queue[take:]
        if not batch:
            return
        now = time.monotonic()
        for _, pending in batch:
            if pending.released is None:
                pending.released = now
        # one MULTI/EXEC: a worker blocked on the stream wakes once to all of them, not to
        # the first alone (whose episode would then decode as a batch of one)
        with tracing.span("queue tasks", "tasks", tasks=len(batch)):
            async with self.r.pipeline(transaction=True) as pipe:
                for t, _ in batch:
                    entry: dict[Any, Any] = self.signer.fields(streams.TASKS, t)
                    pipe.xadd(streams.TASKS, entry)
                added = await pipe.execute()
        for (_, pending), entry_id in zip(batch, added, strict=True):
            pending.ids.append(entry_id)

    async def collect(self, wanted: set[str], stop: asyncio.Event | None = None) -> None:
        """Read rollouts until every task id of `wanted` has one in `arrived`, adding queued
        tasks as the stream has room. A rollout of no submitted task, or served by another
        adapter version than its task names (left over from a learner that died), is
        dropped. With `stop` (reading ahead while the learner trains): also return once it
        is set, within ~50 ms, and leave the step's deadline to the gather that follows."""
        deadline = time.monotonic() + self.spec.train.step_timeout_s if stop is None else math.inf
        block_ms = 500 if stop is None else 50
        while stop is None or not stop.is_set():
            try:
                await self.add_tasks()
                if not (missing := len(wanted - self.arrived.keys())):
                    return
                entries = await streams.read_group(
                    self.r, self.stream, LEARNER_GROUP, self.consumer, count=1024,
                    block_ms=block_ms,
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
                task = self.expected.get(rollout.task_id)
                if task is None or not _current(rollout, task, self.spec.train.staleness_scope):
                    continue
                if rollout.task_id in self.arrived:
                    log.info("dropped a second rollout of task %s", rollout.task_id)
                    await self.r.hincrby(run_key(self.run_id), "duplicate_rollouts", 1)
                    continue
                self.arrived[rollout.task_id] = rollout
                if (rollout.error or "").startswith(streams.DEAD_LETTERED):
                    await self.r.hincrby(run_key(self.run_id), "dead_lettered", 1)
            if entries:
                ids = [e.id for e in entries]
                await streams.ack(self.r, self.stream, LEARNER_GROUP, *ids, delete=True)
            elif stop is None:
                await self.check_cancel()
            if time.monotonic() > deadline:
                raise RunFailed(
                    f"only {len(wanted) - missing}/{len(wanted)} rollouts arrived within "
                    f"train.step_timeout_s={self.spec.train.step_timeout_s:.0f}s; "
                    "are workflow workers running?"
                )


def _current(rollout: Rollout, task: Task, scope: str) -> bool:
    """Whether every turn was served by the version its task named (`episode` scope) or by
    that version or a newer one (`turn` scope: each turn takes the newest)."""
    return all(
        t.adapter.version == task.adapters[t.role].version
        or (scope == "turn" and t.adapter.version > task.adapters[t.role].version)
        for t in rollout.turns
        if t.role in task.adapters
    )
