"""Executes one training run: a short loop over parts that each do one job.

`RunExecutor.execute` is the loop. Step t: its schedule hands it the step's rollouts
(the sampler picks the problems, `Episodes` runs each group_size times through the
workflow with adapter version t); failed episodes are counted; the rollouts that train are
selected (dynamic sampling, staleness); the GRPO update runs (update.py); the schedule
pushes version t+1 of every adapter to every live inference replica, runs the validator
and the checkpointer when they are due and sends the record to every metrics sink. A step
that lost more than `train.max_failed_fraction` of its episodes is a failed step, and a
run that ends with more than `train.max_failed_steps` of its steps failed ends FAILED
(outcome.py).

Two schedules (schedules.py): `Synchronous` (`train.max_staleness` 0) and
`RolloutsAhead` (>= 1), each a small object with the same parts: the step's rollouts,
after its update, its push and record, and the end of the run.

A run whose learner died is taken over by this code too (`takeover`): it
resumes from the last checkpoint under the same run id, with the metrics logged
after that checkpoint cut back and a fresh range of adapter versions.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import redis.asyncio as aioredis

from marl.data import load_problems
from marl.models.identity import base_model_id
from marl.runtime import heap, tracing
from marl.runtime.aio_tasks import cancel_until_done
from marl.runtime.fences import StaleFence
from marl.runtime.task_signing import TaskSigner
from marl.runtime.torch_thread import TorchThread
from marl.spec.run import RunSpec, dump_spec
from marl.spec.services import LearnerConfig, auth_token
from marl.workflows import policy_of_role
from services.learner.adapter_sync import AdapterSync, Published
from services.learner.checkpoint import Checkpointer
from services.learner.episodes import Episodes
from services.learner.errors import RunCancelled, RunFailed, RunStopped
from services.learner.guard import Action, spare_adapters
from services.learner.lease import Lease, LeaseLost
from services.learner.outcome import step_failed
from services.learner.records import step_record
from services.learner.run_log import RunLog
from services.learner.runs import RunStore
from services.learner.sampler import DataSampler
from services.learner.schedules import RolloutsAhead, Synchronous
from services.learner.sinks import MetricsSink, RunRecordSink
from services.learner.staleness import drop_stale
from services.learner.step_clock import StepClock
from services.learner.validator import Validator

if TYPE_CHECKING:
    from marl.problem import Problem
    from marl.rollout import Rollout
    from services.learner.policy_pool import PolicyPool
    from services.learner.ranks import PolicyHandle
    from services.learner.threads import ThreadBurst

log = logging.getLogger(__name__)

FAILED_STEPS_LIMIT = 3
"""Consecutive steps with every episode failed after which the run fails: a setting every
episode trips on (a prompt cap below every prompt, a sandbox that never answers) ends the
run with its error instead of training nothing up to the last step, while an outage a step
or two long (a restarting sandbox) is ridden out."""


@dataclass
class Loop:
    """What a run's loop and its schedule share."""

    policy: PolicyHandle
    sampler: DataSampler
    validator: Validator
    checkpointer: Checkpointer
    start: int
    """The first step to train: 0, or the step a checkpoint resumes from."""
    failed_in_a_row: int = 0
    """Steps in a row up to this one whose every episode failed (`outcome` counts the
    steps that lost more than train.max_failed_fraction, in a row or not)."""


@dataclass
class Trained:
    """A step trained, before its push and record."""

    step: int
    """The step it is logged as: its adapters are version `step`."""
    record: dict[str, Any]
    rollouts: list[Rollout]
    clock: StepClock
    drift_later: bool = False
    """Its per-role signals are measured after its push (`update.measure_drift`)."""


def measuring_drift(torch: TorchThread, policy: PolicyHandle) -> asyncio.Future[dict[str, float]]:
    """The step's per-role signals (`update.measure_drift`), measured on the torch thread
    while its push goes out and the next step's tasks leave behind it."""
    from services.learner.update import measure_drift

    return asyncio.ensure_future(torch.run(policy.call, measure_drift))


def trim_heap(policy: PolicyHandle | None, run_id: str) -> None:
    """The heap trim (`marl.runtime.heap`) of the processes that hold the policy and of the server
    (None: a closed policy, the server's alone), run on the torch thread so that it never
    overlaps an update: one step ahead, a step's record is written while the next update
    runs, and a trim then handed back the pages of the activations that update was freeing
    and reallocating, each to be faulted in again (`bench/heap_trim.py` counts the faults
    and times both). After each step only where other runs may use the pages
    (`RunExecutor.trim_each_step`: `learner.max_concurrent_runs` > 1); a run alone on its
    learner reuses them in its next step, and its heap is trimmed once, when it ends."""
    with tracing.span("heap trim", run=run_id):
        if policy is None:
            heap.release_free_heap()
        else:
            policy.release_free_heap()


class RunExecutor:
    def __init__(
        self,
        run_id: str,
        spec: RunSpec,
        out_dir: Path,
        r: aioredis.Redis,
        store: RunStore,
        learner_id: str,
        takeover: int = 0,
        extra_sinks: list[MetricsSink] | None = None,
        *,
        learner: LearnerConfig,
        torch_thread: TorchThread | None = None,
        owner: str = "",
        lease: Lease | None = None,
        stop: asyncio.Event | None = None,
        policy_pool: PolicyPool | None = None,
    ):
        """`learner`: the learner process's settings this run reads, its bound on queued
        tasks and `burst_threads`, the torch threads the update may take once every rollout
        queued ahead is in (`threads.ThreadBurst`; 0, or a synchronous run: its own share).
        `owner`: the user who submitted the run, the one user its adapters are served to.
        `lease`: the run's lease, checked before every push and checkpoint, whose fencing
        token they carry (None: a run no other learner can take, as in tests). `stop`: set
        when the learner stops (SIGTERM; `stop_here`). `policy_pool`: the learner's policy
        processes (policy_pool.py)."""
        self.run_id = run_id
        from services.learner.ranks import policy_elsewhere

        torch_thread = None if policy_elsewhere(spec) else torch_thread
        self.torch = torch_thread or TorchThread("learner")
        """Where the policy's torch work runs: the process's one torch thread, or one of the
        run's own that waits on a policy in other processes (runs then update side by side)."""
        self._own_torch_thread = torch_thread is None
        self.spec = spec
        self.out_dir = out_dir
        self.r = r
        self.store = store
        self.roles = policy_of_role(spec)
        self.takeover = takeover
        """0 for the run's first learner; n for the n-th learner that took it over."""
        self.lease = lease
        self.stop = stop or asyncio.Event()
        self.saved_step: int | None = None
        """The step of the last checkpoint this run has (restored or saved)."""
        self.adapters = AdapterSync(
            run_id, spec, r, self.roles, base_model_id(spec.model.path), self.torch,
            # each learner of the run, and each rollback within it, a range of its own
            version_base=takeover * (spec.guard.max_rollbacks + 1) * (spec.train.steps + 1),
            check_cancel=self.check_cancel, owner=owner, lease=lease,
        )
        self.episodes = Episodes(
            run_id, spec, r, learner_id, adapters=self.adapters.refs,
            check_cancel=self.check_cancel, max_queued_tasks=learner.max_queued_tasks,
            signer=TaskSigner(auth_token()),
        )
        self.spares = spare_adapters(spec, self.roles)
        """Role -> the adapter a split would give it (guard.py); built with the others."""
        self.records = RunLog(
            run_id, spec, out_dir, r, store,
            roles=self.roles, spares=self.spares, extra_sinks=extra_sinks,
        )
        self.guard = self.records.guard
        self.data_position = 0
        """The data position a checkpoint of the step just trained resumes from."""
        self.burst_threads = learner.burst_threads
        self.trim_each_step = learner.max_concurrent_runs > 1  # see `trim_heap`
        self.burst: ThreadBurst | None = None
        self.policy_pool = policy_pool

    async def execute(self) -> None:
        """The run: its policy opened, then the step loop (`train.steps` steps, each its
        rollouts, its selection, the GRPO update on the torch thread, and its push and
        record as the schedule says), then everything it opened closed."""
        from services.learner.ranks import close_policy
        from services.learner.update import grpo_step

        spec = self.spec
        await self.adapters.start()
        try:
            policy, loop = await self.open()
            schedule = (
                RolloutsAhead(self, loop) if spec.train.max_staleness > 0
                else Synchronous(self, loop)
            )
            try:
                for step in range(loop.start, spec.train.steps):
                    await self.check_cancel()
                    if self.stop.is_set():
                        await self.stop_here(schedule, loop, step)
                    clock = StepClock(time.monotonic())
                    rollouts = await unless_stopped(self.stop, schedule.rollouts(step, clock))
                    if rollouts is None:
                        await self.stop_here(schedule, loop, step)
                    failed_step = await count_failures(
                        self.records.record, self.spec, loop, step, rollouts
                    )
                    rollouts, trained, selection = await self.select(loop, step, rollouts)
                    ahead = reading_ahead(
                        self.burst, self.episodes, schedule.ahead.task_ids(), self.run_id
                    )
                    drift_later = schedule.drift_later(step + 1)
                    async with ahead as burst_s:
                        result = await self.torch.run(
                            policy.call, partial(grpo_step, drift_later=drift_later), trained,
                            [r.problem_id for r in trained], self.roles, spec,
                        )
                    clock.updated = time.monotonic()
                    await schedule.updated()
                    self.adapters.set_step(step + 1)
                    record = step_record(
                        rollouts, spec.workflow, result.metrics,
                        selection=selection,
                        failed_step=failed_step,
                        clock=clock,
                        burst_s=None if self.burst is None else burst_s[0],
                    )
                    await schedule.publish(
                        Trained(step + 1, record, rollouts, clock, drift_later)
                    )
                await schedule.drain()
                failure = self.records.record.outcome.verdict(spec.train)
                if failure is not None:
                    raise RunFailed(failure)
            except RunCancelled:
                await schedule.drain()  # the step it trained is logged, as a synchronous run's is
                raise
            finally:
                await schedule.close()
                await self.torch.run(close_policy, policy)
                await self.torch.run(trim_heap, None, self.run_id)
        finally:
            await self.close()

    async def open(self) -> tuple[PolicyHandle, Loop]:
        """The run's data, its episodes' stream and its policy; the loop's parts from the
        last checkpoint if there is one (`resume`)."""
        from services.learner.group import joined
        from services.learner.ranks import close_policy, open_policy
        from services.learner.threads import ThreadBurst

        spec = self.spec
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "run.yaml").write_text(dump_spec(spec))
        train = load_problems(spec.data, "train", spec.seed)
        val = load_problems(spec.data, "val", spec.seed)[: spec.train.val_problems]
        if spec.train.problems_per_step > len(train):
            raise RunFailed(
                f"train.problems_per_step={spec.train.problems_per_step} is larger than the "
                f"training set ({len(train)} problems in data.train={spec.data.train!r}); "
                "lower it or use a larger data set"
            )
        await self.episodes.open(fresh=self.takeover > 0)
        # a synchronous run's update has every core anyway; the ranks' threads are theirs
        if spec.train.max_staleness > 0 and spec.learner.world_size == 1 and not joined():
            self.burst = ThreadBurst.of_this_process(self.burst_threads)
        # the spares after the routed adapters: those initialise as in a run without them
        adapters = sorted(set(self.roles.values())) + sorted(set(self.spares.values()))
        policy = await self.torch.run(open_policy, spec, adapters, self.burst, self.policy_pool)
        try:
            return policy, await self.resume(policy, train, val)
        except BaseException:
            await self.torch.run(close_policy, policy)
            raise

    async def close(self) -> None:
        """What the run opened, closed: the burst's threads back to their share, the
        adapters and (unless the lease was lost) the rollouts stream released, the sinks."""
        if self.burst is not None:
            await self.torch.run(self.burst.keep_share)
        # a run whose lease was lost is another learner's: its adapters and its
        # rollouts stream stay for that learner
        held = self.lease is None or self.lease.lost is None
        await self.adapters.close(release=held)
        if held:
            await self.episodes.close()
        await self.records.close()
        if self._own_torch_thread:
            self.torch.close()

    async def stop_here(self, schedule: RolloutsAhead | Synchronous, loop: Loop, step: int
                        ) -> NoReturn:
        """The learner is stopping before step `step` trains: the step before's push and
        record finish, a checkpoint of `step` steps done is written (unless one is there),
        then RunStopped. The next learner resumes at `step` and draws its problems again.
        What fails meanwhile (Redis gone, a push refused) is logged, not recorded: the run
        stays the next learner's, from the last checkpoint there is."""
        try:
            await schedule.drain()
            if self.saved_step != step and step > 0:
                self.data_position = schedule.ahead.position(step)
                await self.save(loop.checkpointer, step, loop.policy, None)
                log.info("stopping: checkpointed run %s at step %d", self.run_id, step)
        except LeaseLost:
            raise
        except Exception as err:
            log.error("stopping: could not checkpoint run %s at step %d: %s", self.run_id,
                      step, err)
        raise RunStopped(f"the learner stopped; run {self.run_id} resumes from its last "
                         "checkpoint")

    async def resume(self, policy: PolicyHandle, train: list[Problem], val: list[Problem]) -> Loop:
        """The loop's parts, from the last checkpoint if there is one (its data position,
        rollbacks and routing; the records logged after it cut back and the rest replayed),
        with the adapters pushed and, on a fresh run, step 0 validated."""
        spec = self.spec
        sampler = DataSampler(train, spec.seed)
        validator = Validator(val, spec.train.val_interval, spec.train.steps, self.episodes)
        checkpointer = Checkpointer(
            self.out_dir,
            spec.train.checkpoint_interval,
            spec.train.steps,
            spec.train.checkpoints_kept,
            fence=None if self.lease is None else self.lease.fence,
        )
        try:  # before anything is read: an older lease's learner can write no more here
            await self.torch.run(checkpointer.claim)
        except StaleFence as err:
            assert self.lease is not None
            raise self.lease.lost_to(str(err)) from None
        restored = await self.torch.run(checkpointer.restore, policy)
        start = 0 if restored is None else int(restored["step"])
        self.saved_step = None if restored is None else start
        if restored is not None:
            sampler.position = int(restored["data_position"])
            log.info("resumed %s at step %d", self.run_id, start)
        if restored is not None or self.takeover:
            self.records.jsonl.cut_back(None if restored is None else start)
            await self.records.stream.cut_back(None if restored is None else start)
            await self.records.replay(self.records.jsonl.records())
        if restored is not None:
            self.guard.rollbacks = int(restored.get("rollbacks", 0))
            self.roles.update(restored.get("routing") or {})  # a split survives resume
            self.adapters.reroute()
        self.adapters.set_step(start)
        await self.adapters.push(policy)
        if start == 0:
            await self.record_step(0, await validator.run(0))
        return Loop(policy, sampler, validator, checkpointer, start)

    async def select(
        self, loop: Loop, step: int, rollouts: list[Rollout]
    ) -> tuple[list[Rollout], list[Rollout], dict[str, float]]:
        """The step's rollouts that train: with dynamic sampling those of the groups with
        signal (topped up from the data order), then those no more than
        train.max_staleness versions behind. Returns every rollout the step gathered,
        those that train, and the record of what was dropped."""
        from services.learner.dynamic_sampling import dynamic_sampling

        spec = self.spec
        topped: dict[str, float] = {}
        signal = rollouts
        if spec.grpo.dynamic_sampling:  # DAPO: groups with no signal make way
            rollouts, signal, topped = await dynamic_sampling(
                rollouts,
                partial(
                    top_up, self.episodes, loop.sampler, step, {r.problem_id for r in rollouts}
                ),
                spec,
            )
        current = {ref.name: ref.version for ref in self.adapters.refs().values()}
        trained, staleness = drop_stale(signal, current, spec.train.max_staleness)
        return rollouts, trained, {**staleness, **topped}

    async def publish(
        self,
        loop: Loop,
        trained: Trained,
        judged: tuple[dict[str, Any], Action | None] | None,
        pushed: asyncio.Event | None,
        position: int,
    ) -> None:
        """A step's push and record, in line: the adapters go out, and the tasks queued
        behind them (`pushed`) with them (`AdapterSync.send`), its rollouts are logged, validation and the checkpoint
        (resuming at data `position`) run when due, and the record goes through the
        alarms and the guard to every sink."""
        done, record, clock, policy = trained.step, trained.record, trained.clock, loop.policy

        async def release() -> None:  # the tasks `pushed` holds back, beside the push
            assert pushed is not None
            pushed.set()
            await self.episodes.add_tasks()

        snapshot = await self.adapters.snapshot(policy)
        drift = measuring_drift(self.torch, policy) if trained.drift_later else None
        try:
            await self.adapters.send(snapshot, None if pushed is None else release)
            clock.pushed = time.monotonic()
        finally:
            if drift is not None:
                record.update(await drift)
        with tracing.span("rollout log", run=self.run_id, step=done):
            self.records.rollouts.write(done, trained.rollouts)
        if loop.validator.due(done):
            record.update(await loop.validator.run(done))
        accuracy = record.get("val/accuracy")
        self.data_position = position
        if loop.checkpointer.due(done, accuracy):
            await self.save(loop.checkpointer, done, policy, accuracy)
        record.update(clock.push_times(time.monotonic()))
        clock.trace(self.run_id, done, clock.start + record["time/step_s"])
        with tracing.span("record", run=self.run_id, step=done):
            await self.record_step(done, record, policy, loop.checkpointer, judged)
        if self.trim_each_step:
            await self.torch.run(trim_heap, policy, self.run_id)

    async def save(
        self, checkpointer: Checkpointer, step: int, policy: PolicyHandle, accuracy: float | None
    ) -> None:
        """Checkpoint the step, while this learner still holds the run's lease; the
        checkpoint directory refuses it too if a newer lease's token is written there."""
        if self.lease is not None:
            await self.lease.check()
        # besides the weights: where the data order resumes, the adapters' versions, the
        # rollbacks so far and the routing (role -> adapter)
        state = {
            "data_position": self.data_position,
            "versions": self.adapters.versions,
            "rollbacks": self.guard.rollbacks,
            "routing": dict(self.roles),
        }
        try:
            await self.torch.run(checkpointer.save, step, policy, state, accuracy)
            self.saved_step = step
        except StaleFence as err:
            if self.lease is not None:
                raise self.lease.lost_to(str(err)) from None
            raise

    async def finish(
        self,
        policy: PolicyHandle,
        step: int,
        full: dict[str, Any],
        rollouts: list[Rollout],
        snapshot: dict[str, Published],
        pushed: asyncio.Event,
    ) -> None:
        """An overlapped step's push and record, while the next step trains: the adapters
        go out, the tasks queued meanwhile follow them to the workers, the step is logged.
        The step's `time/step_s` and `time/push_s` end where the next step starts (the
        push's snapshot of the weights); the rest of the push, which no step waits for, is
        `time/push_overlapped_s`."""
        sent = time.monotonic()
        await self.adapters.send(snapshot)
        pushed.set()
        await self.episodes.add_tasks()
        full["time/push_overlapped_s"] = time.monotonic() - sent
        tracing.add("push overlapped", sent, sent + full["time/push_overlapped_s"],
                  "push overlapped", run=self.run_id, step=step)
        with tracing.span("rollout log", run=self.run_id, step=step):
            self.records.rollouts.write(step, rollouts)
        with tracing.span("record", run=self.run_id, step=step):
            await self.records.write(step, full, None)
        if self.trim_each_step:
            await self.torch.run(trim_heap, policy, self.run_id)

    async def check_cancel(self) -> None:
        if await self.store.cancel_requested(self.run_id):
            raise RunCancelled()

    async def record_step(
        self,
        step: int,
        record: dict[str, Any],
        policy: PolicyHandle | None = None,
        checkpointer: Checkpointer | None = None,
        judged: tuple[dict[str, Any], Action | None] | None = None,
    ) -> None:
        """The step's record through the alarms, then the guard's action carried out (a
        split gives the role its own adapter, a rollback restores the last checkpoint, a
        stop ends the run after the record), then every sink. `judged`: what
        `RunLog.judge` made of the record before its last fields were added."""
        full, action = self.records.judge(step, record) if judged is None else judged
        full.update(record)
        if action is not None and action.kind == "stop":
            full["guard"] = f"stop: {action.alarm}"
        elif action is not None and action.kind == "split":
            assert policy is not None and checkpointer is not None
            split = await self.torch.run(self.guard.split, policy, self.roles, action.alarm.role)
            if split is None:
                full["guard"] = f"warn: {action.alarm} (split: the role has its own adapter)"
            else:
                full["guard"] = f"split: {action.alarm} -> {split}"
                full["routing"] = ",".join(f"{r}={a}" for r, a in sorted(self.roles.items()))
                self.adapters.reroute()
                self.adapters.set_step(step)
                await self.adapters.push(policy)
                # before the record: a run resumed from here trains on with the new routing
                await self.save(checkpointer, step, policy, None)
        elif action is not None and policy is not None and checkpointer is not None:
            done = await self.torch.run(self.guard.roll_back, policy, checkpointer)
            if done is None:
                full["guard"] = f"warn: {action.alarm} (rollback: no checkpoint yet)"
            else:
                full["guard"] = f"rollback: {action.alarm} -> {done}"
                self.adapters.version_base += self.spec.train.steps + 1
                self.adapters.set_step(step)
                await self.adapters.push(policy)
        await self.records.write(step, full, action)


async def unless_stopped(stop: asyncio.Event, gathering: Awaitable[list[Rollout]]
                         ) -> list[Rollout] | None:
    """The step's rollouts, or None when the learner is asked to stop first: the
    gathering is abandoned (nothing of the step has touched the policy yet)."""
    task = asyncio.ensure_future(gathering)
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            await cancel_until_done([task])
        await cancel_until_done([stopped])
    return None if task.cancelled() else task.result()


async def count_failures(
    record: RunRecordSink, spec: RunSpec, loop: Loop, step: int, rollouts: list[Rollout]
) -> bool:
    """Whether the step failed (lost more than train.max_failed_fraction of its
    episodes). FAILED_STEPS_LIMIT steps in a row with every episode failed fail the run."""
    failed = [r.error for r in rollouts if r.error is not None]
    failed_step = step_failed(len(rollouts), len(failed), spec.train.max_failed_fraction)
    loop.failed_in_a_row = loop.failed_in_a_row + 1 if len(failed) == len(rollouts) > 0 else 0
    if loop.failed_in_a_row >= FAILED_STEPS_LIMIT:
        await record.note_unlogged(len(rollouts), len(failed), failed_step)
        raise RunFailed(
            f"every episode of steps {step + 2 - loop.failed_in_a_row}-{step + 1} failed, "
            f"so they trained nothing; the last one's error: {failed[-1]}"
        )
    return failed_step


async def top_up(
    episodes: Episodes, sampler: DataSampler, step: int, held: set[str], n: int
) -> list[Rollout]:
    """Dynamic sampling's top-up: the rollouts of the next `n` problems of the data order
    that step `step` does not hold yet (`held`, their ids, grows with them), run as
    step `step`'s (task ids stay distinct: one problem once a step)."""
    problems: list[Problem] = []
    while len(problems) < n and len(held) < len(sampler.problems):
        problems += [p for p in sampler.next(n - len(problems)) if p.id not in held]
        held |= {p.id for p in problems}
    return await episodes.run(problems, step, "train")


@asynccontextmanager
async def reading_ahead(
    burst: ThreadBurst | None, episodes: Episodes, ahead: set[str], run_id: str
) -> AsyncIterator[list[float]]:
    """Around a step's update: the rollouts of the tasks queued `ahead` are read while it
    runs, and once all are in the update takes the cores their generation leaves idle
    (`burst`, a ThreadBurst). Yields a list that holds, after, the seconds it ran with them."""
    burst_s = [0.0]
    if burst is None:
        yield burst_s
        return
    burst.start_step()
    stop = asyncio.Event()

    async def read_ahead() -> None:
        with tracing.span("read ahead", "read ahead", run=run_id):
            await episodes.collect(ahead, stop)
        if ahead <= episodes.arrived.keys():
            burst.rollouts_in()

    reader = asyncio.create_task(read_ahead())
    try:
        yield burst_s
        burst_s[0] = burst.burst_seconds()
    finally:
        stop.set()
        await reader
