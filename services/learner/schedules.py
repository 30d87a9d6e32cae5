"""When a step's tasks go out, and when its push and record happen: a run's two schedules.

Both have the same parts, which the loop (trainer.py) calls in order: `rollouts` (the
step's, once all are in), `updated` (its update is done), `publish` (its push and record),
and at the end `drain` and `close`. `TasksAhead` keeps the steps submitted before they
train.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from services.learner.guard import acts

if TYPE_CHECKING:
    from marl.rollout import Rollout
    from services.learner.episodes import Pending
    from services.learner.sampler import DataSampler
    from services.learner.step_clock import StepClock
    from services.learner.trainer import Loop, RunExecutor, Trained


class TasksAhead:
    """The steps submitted and not trained yet: their tasks, and the data position before
    their problems (a checkpoint saved before they train resumes there, and draws them
    again)."""

    def __init__(self, run: RunExecutor, sampler: DataSampler):
        self.run = run
        self.sampler = sampler
        self.steps: dict[int, tuple[Pending, int]] = {}

    def submit(self, step: int, after: asyncio.Event | None) -> None:
        """Step `step`'s tasks with the adapter versions current now; they wait in the
        learner's queue until `after` is set (None: they leave now)."""
        position = self.sampler.position
        problems = self.sampler.next(self.run.spec.train.problems_per_step)
        self.steps[step] = (self.run.episodes.submit(problems, step, "train", after), position)

    async def gather(self, step: int, clock: StepClock) -> list[Rollout]:
        """Step `step`'s rollouts, once all are in. The step stays among those ahead until
        then: a gather abandoned (a learner stopping) leaves its data position."""
        pending = self.steps[step][0]
        rollouts = await self.run.episodes.gather(pending)
        del self.steps[step]
        clock.gathered = time.monotonic()
        clock.released = clock.start if pending.released is None else pending.released
        return rollouts

    def task_ids(self) -> set[str]:
        return {t.id for pending, _ in self.steps.values() for t in pending.tasks}

    def position(self, done: int) -> int:
        """The data position a checkpoint of step `done` resumes from."""
        return self.steps[done][1] if done in self.steps else self.sampler.position

    async def withdraw(self) -> None:
        """The run ended with steps queued ahead: their tasks go."""
        for pending, _ in self.steps.values():
            await self.run.episodes.withdraw(pending)


class Synchronous:
    """`train.max_staleness` 0: a step trains on rollouts of the adapters it pushed last.

    With no validation due, the next step's tasks are queued before the push and leave for
    the workers once it is acked: the workers generate them while this step's rollouts,
    checkpoint and record are written. The tasks name the versions just pushed, so the run
    stays on-policy."""

    def __init__(self, run: RunExecutor, loop: Loop):
        self.run = run
        self.loop = loop
        self.ahead = TasksAhead(run, loop.sampler)

    async def rollouts(self, step: int, clock: StepClock) -> list[Rollout]:
        if step not in self.ahead.steps:
            self.ahead.submit(step, None)
        return await self.ahead.gather(step, clock)

    async def updated(self) -> None:
        pass

    def drift_later(self, done: int) -> bool:
        """Whether step `done`'s per-role signals wait until the next step's tasks are out
        (`update.measure_drift`), their forward then running beside that step's generation:
        when those tasks are queued ahead and no alarm makes the guard act (every
        `guard.on_alarm` warns), so nothing they wait for reads the signals."""
        return self.next_step_ahead(done) and not acts(self.run.spec)

    async def publish(self, trained: Trained) -> None:
        judged = None
        pushed = None
        if self.next_step_ahead(trained.step):
            # the next step's tasks follow this push to the workers, and are generated
            # while this step is checkpointed and logged
            if not trained.drift_later:  # else the guard cannot act: judged with the record
                judged = self.run.records.judge(trained.step, trained.record)
            if judged is None or judged[1] is None:  # nothing before it to wait for
                pushed = asyncio.Event()
                self.ahead.submit(trained.step, pushed)
        position = self.ahead.position(trained.step)
        await self.run.publish(self.loop, trained, judged, pushed, position)

    def next_step_ahead(self, done: int) -> bool:
        """Whether step `done`'s tasks are queued as soon as the adapters that serve them
        are pushed, before step `done - 1` is logged and checkpointed: when there is a next
        step and no validation comes between (the guard may act on its accuracy, and so on
        nothing before it). A checkpoint saved meanwhile records the data position before
        the step queued ahead, so a resumed run queues it again."""
        return done < self.run.spec.train.steps and not self.loop.validator.due(done)

    async def drain(self) -> None:
        pass

    async def close(self) -> None:
        await self.ahead.withdraw()


class RolloutsAhead:
    """`train.max_staleness` K >= 1: the tasks of the next K steps are out, with the
    adapter versions current when they were queued.

    A step with no checkpoint or validation due does not wait for its push and its record:
    it snapshots the adapters' weights and the next update starts while
    `RunExecutor.finish` sends them, releases the tasks queued behind them (they name the
    new versions, so they wait in the learner's queue until every push is acked) and logs
    the record. At most one such step is in flight; its errors surface when the next update
    ends. A step whose record fires an alarm the guard acts on (stop or rollback) runs the
    synchronous way."""

    def __init__(self, run: RunExecutor, loop: Loop):
        self.run = run
        self.loop = loop
        self.ahead = TasksAhead(run, loop.sampler)
        self.finishing: asyncio.Task[None] | None = None
        """The last step's push and record, still running beside this step."""
        self.pushed: asyncio.Event | None = None
        """Set once that push is acked: tasks queued meanwhile name its versions."""

    async def rollouts(self, step: int, clock: StepClock) -> list[Rollout]:
        # this step's tasks, and the next max_staleness steps' with today's versions
        steps = self.run.spec.train.steps
        for s in range(step, min(step + self.run.spec.train.max_staleness + 1, steps)):
            if s not in self.ahead.steps:
                self.ahead.submit(s, self.pushed)
        return await self.ahead.gather(step, clock)

    def drift_later(self, done: int) -> bool:
        """Never: the next update starts while this step is pushed."""
        return False

    async def updated(self) -> None:
        if self.finishing is not None:
            await self.finishing
            self.finishing = self.pushed = None

    async def publish(self, trained: Trained) -> None:
        run, loop, done, clock = self.run, self.loop, trained.step, trained.clock
        judged = None
        if not (loop.validator.due(done) or loop.checkpointer.due(done, None)):
            judged = full, action = run.records.judge(done, trained.record)
            if action is None:
                snapshot = await run.adapters.snapshot(loop.policy)
                clock.pushed = time.monotonic()
                full.update(clock.push_times(clock.pushed))
                clock.trace(run.run_id, done, clock.pushed)
                self.pushed = asyncio.Event()
                self.finishing = asyncio.create_task(
                    run.finish(loop.policy, done, full, trained.rollouts, snapshot, self.pushed)
                )
                return
        await run.publish(loop, trained, judged, None, self.ahead.position(done))

    async def drain(self) -> None:
        if self.finishing is not None:
            await self.finishing

    async def close(self) -> None:
        if self.finishing is not None and not self.finishing.done():
            self.finishing.cancel()
            await asyncio.gather(self.finishing, return_exceptions=True)
        await self.ahead.withdraw()
