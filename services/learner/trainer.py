"""Executes one training run: a short loop over parts that each do one job.

Step t: the sampler picks the step's problems; `Episodes` runs each of them
group_size times through the workflow with adapter version t and collects the
rollouts; the GRPO update runs (update.py, its per-role signals in
diagnostics.py); `AdapterSync` pushes version t+1 of every adapter to every live
inference replica; the validator and the checkpointer act when they are due;
the record goes to every metrics sink. A step that lost more than
`train.max_failed_fraction` of its episodes is a failed step, and a run that ends with
more than `train.max_failed_steps` of its steps failed ends FAILED (outcome.py).

With `train.max_staleness` >= 1 a step with no checkpoint or validation due does not
wait for its push and its record: it snapshots the adapters' weights and the next
update starts while `finish` sends them, releases the tasks queued behind them (they
name the new versions, so they wait in the learner's queue until every push is acked)
and logs the record. At most one such step is in flight; its errors surface when the
next update ends. A step whose record fires an alarm the guard acts on (stop or
rollback) runs the synchronous way.

A synchronous run (`max_staleness` 0) with no validation due queues the next step's
tasks before its push, and they leave for the workers once it is acked: the workers
generate them while this step's rollouts, checkpoint and record are written. The tasks name
the versions just pushed, so the run stays on-policy. `time/rollout_flight_s` is the
time from a step's tasks leaving to its last rollout arriving; `time/rollout_s` only the
part the learner waited for.

A run whose learner died is taken over by this code too (`takeover`): it
resumes from the last checkpoint under the same run id, with the metrics logged
after that checkpoint cut back and a fresh range of adapter versions.
"""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis

from marl.data import load_problems
from marl.diagnostics.alarms import AlarmWatch
from marl.diagnostics.signatures import parallel_roles, role_signatures
from marl.models.identity import base_model_id
from marl.runtime import trace
from marl.runtime.torch_thread import TorchThread
from marl.spec.run import RunSpec, dump_spec
from marl.workflows import policy_of_role
from services.learner.adapter_sync import AdapterSync, Published
from services.learner.checkpoint import Checkpointer
from services.learner.episodes import Episodes, Pending
from services.learner.errors import ReplicaUnreachable, RunCancelled, RunFailed
from services.learner.guard import Action, Guard, GuardStopped, spare_adapters
from services.learner.metrics import (
    JsonlSink,
    MetricsSink,
    RolloutLog,
    RunRecordSink,
    StreamSink,
    rollout_metrics,
)
from services.learner.outcome import step_failed
from services.learner.runs import RunStore
from services.learner.sampler import DataSampler
from services.learner.staleness import drop_stale
from services.learner.validator import Validator

if TYPE_CHECKING:
    from marl.data.problem import Problem
    from marl.rollout import Rollout
    from services.learner.ranks import PolicyHandle
    from services.learner.threads import ThreadBurst

__all__ = [
    "DataSampler",
    "GuardStopped",
    "ReplicaUnreachable",
    "RunCancelled",
    "RunExecutor",
    "RunFailed",
]

log = logging.getLogger(__name__)

FAILED_STEPS_LIMIT = 3
"""Consecutive steps with every episode failed after which the run fails: a setting every
episode trips on (a prompt cap below every prompt, a sandbox that never answers) ends the
run with its error instead of training nothing up to the last step, while an outage a step
or two long (a restarting sandbox) is ridden out."""


def trace_phases(
    run: str, step: int, released: float, t0: float, t1: float, t2: float, t3: float,
    end: float,
) -> None:
    """A logged step's phases as trace spans (time.monotonic() seconds): the step, its
    rollout wait, update and push (one step ahead: the snapshot), and apart, on a lane of
    its own, its rollouts' flight (from `released`, its tasks leaving for the workers,
    which may be before the step began). `marl.monitor.trace_summary` reads them back."""
    for name, start, stop in (
        ("step", t0, end), ("rollout wait", t0, t1), ("update", t1, t2), ("push", t2, t3)
    ):
        trace.add(name, start, stop, run=run, step=step)
    trace.add("rollout flight", released, t1, "rollout flight", run=run, step=step)


def grpo_call(policy: PolicyHandle, *call: Any) -> Any:
    """`policy.call(*call)`, the step's update, on the torch thread and traced there as
    "grpo step" (the event loop's "update" span also holds its wait to hear that it ended)."""
    with trace.span("grpo step"):
        return policy.call(*call)


def trim_heap(policy: PolicyHandle) -> None:
    """The heap trim (`marl.runtime.heap`) of the processes that hold the policy and of the server,
    run on the torch thread so that it never overlaps an update: one step ahead, a step's
    record is written while the next update runs, and a trim then handed back the pages of
    the activations that update was freeing and reallocating, each to be faulted in again
    (`bench/heap_trim.py`: on the demo's Voting step, ~33,000 faults and 7-9 % of the
    update; after it, 5-7 ms and no faults)."""
    with trace.span("heap trim"):
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
        max_queued_tasks: int = 4096,
        torch_thread: TorchThread | None = None,
        burst_threads: int = 0,
    ):
        """`burst_threads`: torch threads the update may take once every rollout queued
        ahead is in (`threads.ThreadBurst`); 0, or a synchronous run: its own share."""
        self.run_id = run_id
        self.torch = torch_thread or TorchThread("learner")
        """Where the policy's torch work runs: the learner process's one torch thread."""
        self._own_torch_thread = torch_thread is None
        self.spec = spec
        self.out_dir = out_dir
        self.r = r
        self.store = store
        self.roles = policy_of_role(spec)
        self.takeover = takeover
        """0 for the run's first learner; n for the n-th learner that took it over."""
        self.adapters = AdapterSync(
            run_id,
            spec,
            r,
            self.roles,
            base_model_id(spec.model.path),
            self.torch,
            # each learner of the run, and each rollback within it, a range of its own
            version_base=takeover * (spec.guard.max_rollbacks + 1) * (spec.train.steps + 1),
            check_cancel=self.check_cancel,
        )
        self.episodes = Episodes(
            run_id, spec, r, learner_id, self.adapters.refs, self.check_cancel, max_queued_tasks
        )
        self.jsonl = JsonlSink(out_dir / "metrics.jsonl")
        self.stream = StreamSink(r, run_id)
        self.record = RunRecordSink(store, run_id)
        self.sinks: list[MetricsSink] = [
            self.jsonl,
            self.record,
            self.stream,
            *(extra_sinks or []),
        ]
        self.rollout_log = RolloutLog(out_dir / "rollouts", spec.train.rollouts_logged)
        adapters = list(self.roles.values())
        self.alarms = AlarmWatch(
            spec.alarms, len(set(adapters)) < len(adapters), parallel_roles(spec.workflow)
        )
        """Role drift alarms over every logged record (a resumed run replays those kept)."""
        self.spares = spare_adapters(spec, self.roles)
        """Role -> the adapter a split would give it (guard.py); built with the others."""
        self.guard = Guard(spec, spares=self.spares)
        self.data_position = 0
        """The data position a checkpoint of the step just trained resumes from."""
        self.burst_threads = burst_threads
        self.burst: ThreadBurst | None = None

    async def execute(self) -> None:
        await self.adapters.start()
        try:
            await self.train()
        finally:
            if self.burst is not None:
                await self.torch.run(self.burst.keep_share)
            await self.adapters.close()
            await self.episodes.close()
            for sink in self.sinks:
                await sink.close()
            if self._own_torch_thread:
                self.torch.close()

    async def train(self) -> None:
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
        if spec.train.max_staleness > 0 and spec.learner.world_size == 1:
            self.burst = ThreadBurst.of_this_process(self.burst_threads)
        # the spares after the routed adapters: those initialise as in a run without them
        adapters = sorted(set(self.roles.values())) + sorted(set(self.spares.values()))
        policy = await self.torch.run(open_policy, spec, adapters, self.burst)
        try:
            await self.train_with(policy, train, val)
        finally:
            await self.torch.run(close_policy, policy)

    async def train_with(  # noqa: C901, PLR0915 (older than the limit; split it when next changed)
        self, policy: PolicyHandle, train: list[Problem], val: list[Problem]
    ) -> None:
        from services.learner.update import dynamic_sampling, grpo_step

        spec = self.spec
        sampler = DataSampler(train, spec.seed)
        validator = Validator(val, spec.train.val_interval, spec.train.steps, self.episodes)
        checkpointer = Checkpointer(
            self.out_dir,
            spec.train.checkpoint_interval,
            spec.train.steps,
            spec.train.checkpoints_kept,
        )
        restored = await self.torch.run(checkpointer.restore, policy)
        start = 0 if restored is None else int(restored["step"])
        if restored is not None:
            sampler.position = int(restored["data_position"])
            log.info("resumed %s at step %d", self.run_id, start)
        if restored is not None or self.takeover:
            self.jsonl.cut_back(None if restored is None else start)
            await self.stream.cut_back(None if restored is None else start)
            await self.replay(self.jsonl.records())
        if restored is not None:
            self.guard.rollbacks = int(restored.get("rollbacks", 0))
            self.roles.update(restored.get("routing") or {})  # a split survives resume
            self.adapters.reroute()
        self.adapters.set_step(start)
        await self.adapters.push(policy)
        if start == 0:
            await self.log(0, await validator.run(0))
        ahead: dict[int, tuple[Pending, int]] = {}
        """Submitted steps not yet trained -> their tasks and the data position before them."""
        finishing: asyncio.Task[None] | None = None
        """The last step's push and record, still running beside this step (K >= 1)."""
        pushed: asyncio.Event | None = None
        """Set once that push is acked: tasks queued meanwhile name its versions."""
        failed_steps = 0
        """Steps in a row up to this one whose every episode failed (`outcome` counts the
        steps that lost more than train.max_failed_fraction, in a row or not)."""

        def submit_ahead(s: int, after: asyncio.Event | None) -> None:
            """Step `s`'s tasks with the adapter versions current now, noting the data
            position before its problems (a checkpoint saved before it trains)."""
            position = sampler.position
            problems = sampler.next(spec.train.problems_per_step)
            ahead[s] = (self.episodes.submit(problems, s, "train", after), position)
        try:
            for step in range(start, spec.train.steps):
                await self.check_cancel()
                t0 = time.monotonic()
                # this step's tasks, and the next max_staleness steps' with today's versions
                for s in range(step, min(step + spec.train.max_staleness + 1, spec.train.steps)):
                    if s not in ahead:
                        submit_ahead(s, pushed)
                this_step = ahead.pop(step)[0]
                rollouts = await self.episodes.gather(this_step)
                t1 = time.monotonic()
                failed = [r.error for r in rollouts if r.error is not None]
                failed_step = step_failed(
                    len(rollouts), len(failed), spec.train.max_failed_fraction
                )
                failed_steps = failed_steps + 1 if len(failed) == len(rollouts) > 0 else 0
                if failed_steps >= FAILED_STEPS_LIMIT:
                    await self.record.note_unlogged(len(rollouts), len(failed), failed_step)
                    raise RunFailed(
                        f"every episode of steps {step + 2 - failed_steps}-{step + 1} failed, "
                        f"so they trained nothing; the last one's error: {failed[-1]}"
                    )
                released = t0 if this_step.released is None else this_step.released
                topped: dict[str, float] = {}
                signal = rollouts
                if spec.grpo.dynamic_sampling:  # DAPO: groups with no signal make way
                    rollouts, signal, topped = await dynamic_sampling(
                        rollouts,
                        partial(self.top_up, sampler, step, {r.problem_id for r in rollouts}),
                        spec,
                    )
                current = {ref.name: ref.version for ref in self.adapters.refs().values()}
                trained, staleness = drop_stale(signal, current, spec.train.max_staleness)
                result, burst_s = await self.update(
                    policy,
                    {t.id for pending, _ in ahead.values() for t in pending.tasks},
                    grpo_step,
                    trained,
                    [r.problem_id for r in trained],
                    self.roles,
                    spec,
                )
                t2 = time.monotonic()
                if finishing is not None:
                    await finishing
                    finishing = pushed = None
                done = step + 1
                self.adapters.set_step(done)
                record: dict[str, Any] = {
                    **rollout_metrics(rollouts),
                    **role_signatures(rollouts, spec.workflow),  # what the drift alarms read
                    **result.metrics,
                    **staleness,
                    **topped,
                    "train/episodes": len(rollouts),
                    "train/failed_step": int(failed_step),
                    "time/rollout_s": t1 - t0,
                    "time/rollout_flight_s": t1 - released,
                    "time/update_s": t2 - t1,
                    **({} if self.burst is None else {"time/update_burst_s": burst_s}),
                }
                judged = None
                if spec.train.max_staleness > 0 and not (
                    validator.due(done) or checkpointer.due(done, None)
                ):
                    judged = full, action = self.judge(done, record)
                    if action is None:
                        snapshot = await self.adapters.snapshot(policy)
                        t3 = time.monotonic()
                        full["time/push_s"] = t3 - t2
                        full["time/step_s"] = t3 - t0
                        trace_phases(self.run_id, done, released, t0, t1, t2, t3, t3)
                        pushed = asyncio.Event()
                        finishing = asyncio.create_task(
                            self.finish(policy, done, full, rollouts, snapshot, pushed)
                        )
                        continue
                if judged is None and self.next_step_ahead(done, validator):
                    # synchronous: the next step's tasks follow this push to the workers, and
                    # are generated while this step is checkpointed and logged
                    judged = full, action = self.judge(done, record)
                    if action is None:
                        pushed = asyncio.Event()
                        submit_ahead(done, pushed)
                await self.adapters.push(policy)
                t3 = time.monotonic()
                if pushed is not None:
                    pushed.set()
                    pushed = None
                    await self.episodes.add_tasks()
                with trace.span("rollout log", run=self.run_id, step=done):
                    self.rollout_log.write(done, rollouts)
                if validator.due(done):
                    record.update(await validator.run(done))
                accuracy = record.get("val/accuracy")
                # the steps submitted ahead are drawn again on resume
                self.data_position = ahead[done][1] if done in ahead else sampler.position
                if checkpointer.due(done, accuracy):
                    state = self.checkpoint_state()
                    await self.torch.run(checkpointer.save, done, policy, state, accuracy)
                record["time/push_s"] = t3 - t2
                record["time/step_s"] = time.monotonic() - t0
                trace_phases(
                    self.run_id, done, released, t0, t1, t2, t3, t0 + record["time/step_s"]
                )
                with trace.span("record", run=self.run_id, step=done):
                    await self.log(done, record, policy, checkpointer, judged)
                await self.torch.run(trim_heap, policy)
            if finishing is not None:
                await finishing
            failure = self.record.outcome.verdict(spec.train)
            if failure is not None:
                raise RunFailed(failure)
        except RunCancelled:
            if finishing is not None:
                await finishing  # the step it trained is logged, as a synchronous run's is
            raise
        finally:
            if finishing is not None and not finishing.done():
                finishing.cancel()
                await asyncio.gather(finishing, return_exceptions=True)
            for pending, _ in ahead.values():  # the run ended with steps queued ahead
                await self.episodes.withdraw(pending)

    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint records besides the weights: where the data order resumes, the
        adapters' versions, the rollbacks so far and the routing (role -> adapter)."""
        return {
            "data_position": self.data_position,
            "versions": self.adapters.versions,
            "rollbacks": self.guard.rollbacks,
            "routing": dict(self.roles),
        }

    async def top_up(
        self, sampler: DataSampler, step: int, held: set[str], n: int
    ) -> list[Rollout]:
        """Dynamic sampling's top-up: the rollouts of the next `n` problems of the data order
        that step `step` does not hold yet (`held`, their ids, grows with them), run as
        step `step`'s (task ids stay distinct: one problem once a step)."""
        problems: list[Problem] = []
        while len(problems) < n and len(held) < len(sampler.problems):
            problems += [p for p in sampler.next(n - len(problems)) if p.id not in held]
            held |= {p.id for p in problems}
        return await self.episodes.run(problems, step, "train")

    def next_step_ahead(self, done: int, validator: Validator) -> bool:
        """Whether a synchronous run queues step `done`'s tasks as soon as the adapters that
        serve them are pushed, before step `done - 1` is logged and checkpointed: when there
        is a next step and no validation comes between (the guard may act on its accuracy,
        and so on nothing before it). A checkpoint saved meanwhile records the data position
        before the step queued ahead, so a resumed run queues it again."""
        return (
            self.spec.train.max_staleness == 0
            and done < self.spec.train.steps
            and not validator.due(done)
        )

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
        trace.add("push overlapped", sent, sent + full["time/push_overlapped_s"],
                  "push overlapped", run=self.run_id, step=step)
        with trace.span("rollout log", run=self.run_id, step=step):
            self.rollout_log.write(step, rollouts)
        with trace.span("record", run=self.run_id, step=step):
            await self.write(step, full, None)
        await self.torch.run(trim_heap, policy)

    async def update(self, policy: PolicyHandle, ahead: set[str], *call: Any) -> tuple[Any, float]:
        """`policy.call(*call)` (the step's update) and the seconds of it run with the burst
        of threads: while it runs, the rollouts of the tasks queued `ahead` are read, and
        once all are in the update takes the cores their generation leaves idle."""
        if self.burst is None:
            return await self.torch.run(grpo_call, policy, *call), 0.0
        burst = self.burst
        burst.start_step()
        stop = asyncio.Event()

        async def read_ahead() -> None:
            with trace.span("read ahead", "read ahead", run=self.run_id):
                await self.episodes.collect(ahead, stop)
            if ahead <= self.episodes.arrived.keys():
                burst.rollouts_in()

        reader = asyncio.create_task(read_ahead())
        try:
            result = await self.torch.run(grpo_call, policy, *call)
            return result, burst.burst_seconds()
        finally:
            stop.set()
            await reader

    async def check_cancel(self) -> None:
        if await self.store.cancel_requested(self.run_id):
            raise RunCancelled()

    async def replay(self, records: list[dict[str, Any]]) -> None:
        """A resumed run's kept records: the alarm watch and the run's alarm list go on
        from them, as if this learner had logged them."""
        for record in records:
            self.alarms.update(record)
        await self.record.restore(records)

    async def log(
        self,
        step: int,
        record: dict[str, Any],
        policy: PolicyHandle | None = None,
        checkpointer: Checkpointer | None = None,
        judged: tuple[dict[str, Any], Action | None] | None = None,
    ) -> None:
        """The record through the alarms, the guard's action, then every sink. `judged`:
        what `judge` made of the record before its last fields were added."""
        full, action = self.judge(step, record) if judged is None else judged
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
                await self.torch.run(checkpointer.save, step, policy, self.checkpoint_state(), None)
        elif action is not None and policy is not None and checkpointer is not None:
            done = await self.torch.run(self.guard.roll_back, policy, checkpointer)
            if done is None:
                full["guard"] = f"warn: {action.alarm} (rollback: no checkpoint yet)"
            else:
                full["guard"] = f"rollback: {action.alarm} -> {done}"
                self.adapters.version_base += self.spec.train.steps + 1
                self.adapters.set_step(step)
                await self.adapters.push(policy)
        await self.write(step, full, action)

    def judge(self, step: int, record: dict[str, Any]) -> tuple[dict[str, Any], Action | None]:
        """The step's full record with the alarms it fires, and what the guard does."""
        full = {"step": step, **record}
        fired = self.alarms.update(full)
        full["alarms"] = [str(a) for a in fired]
        return full, self.guard.decide(fired)

    async def write(self, step: int, full: dict[str, Any], action: Action | None) -> None:
        """The record to every sink; a stop the guard called ends the run after it."""
        for sink in self.sinks:
            await sink.write(step, full)
        if action is not None and action.kind == "stop":
            raise GuardStopped(action.alarm, action.why)
