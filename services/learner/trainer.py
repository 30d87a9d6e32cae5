"""Executes one training run: push adapters, enqueue tasks, gather rollouts, update, repeat.

Step t: every problem of the step's batch is enqueued group_size times with the
adapter version of every policy; when all rollouts are in, the GRPO update
runs, version t+1 of every adapter is pushed to every live inference replica
(each acknowledgement recorded), and step t+1 starts. Validation runs at step
0, every `val_interval` steps and at the end, through the same workflow path.

While the run lasts, the current versions are published in Redis (names and
versions, not weights) and a sync loop pushes them to replicas that start
mid-run; such a replica reports SERVING only once it holds them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import redis.asyncio as aioredis

from marl import adapter_io, replicas, streams
from marl.config import RunSpec, dump_spec, response_cap
from marl.data import load_problems
from marl.data.problem import Problem
from marl.model_id import base_model_id
from marl.rollout import AdapterRef, Rollout, Task
from marl.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from marl.workflows import policy_of_role
from services.learner import checkpoint
from services.learner.runs import RunStore

log = logging.getLogger(__name__)

LEARNER_GROUP = "learner"
PUSH_DEADLINE_S = 300.0
REPLICA_WAIT_S = 300.0
SYNC_INTERVAL_S = 1.0
SYNC_RETRY_S = 5.0
RELEASE_DEADLINE_S = 30.0


class RunCancelled(Exception):
    pass


class RunFailed(Exception):
    """A run cannot go on; the message is for the user."""


class ReplicaUnreachable(RunFailed):
    """A replica could not be reached (it died or is restarting): the step goes on as long
    as another replica took the adapter."""


UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


@dataclass
class Published:
    """The current version of one adapter, kept so replicas that join later get these bytes."""

    version: int
    manifest: common_pb2.AdapterManifest
    payload: bytes


class DataSampler:
    """Deterministic order over the training set: reshuffled per epoch from the seed."""

    def __init__(self, problems: list[Problem], seed: int, position: int = 0):
        self.problems = problems
        self.seed = seed
        self.position = position

    def _order(self, epoch: int) -> list[int]:
        idx = list(range(len(self.problems)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(idx)
        return idx

    def next(self, n: int) -> list[Problem]:
        """The next `n` distinct problems; a step that crosses an epoch boundary skips the
        new epoch's copies of problems it already holds (a repeated problem would share
        its task ids with the first copy and be dropped as a duplicate)."""
        out: list[Problem] = []
        seen: set[str] = set()
        distinct = n <= len(self.problems)
        while len(out) < n:
            epoch, offset = divmod(self.position, len(self.problems))
            problem = self.problems[self._order(epoch)[offset]]
            self.position += 1
            if distinct and problem.id in seen:
                continue
            seen.add(problem.id)
            out.append(problem)
        return out


class RunExecutor:
    def __init__(
        self,
        run_id: str,
        spec: RunSpec,
        out_dir: Path,
        r: aioredis.Redis,
        store: RunStore,
        learner_id: str,
    ):
        self.run_id = run_id
        self.spec = spec
        self.out_dir = out_dir
        self.r = r
        self.store = store
        self.learner_id = learner_id
        self.roles = policy_of_role(spec)
        self.policy_names = sorted(set(self.roles.values()))
        self.base_model = base_model_id(spec.model.path)
        self.versions = dict.fromkeys(self.policy_names, 0)
        self.rollouts_stream = streams.rollouts_stream(run_id)
        self.current: dict[str, Published] = {}
        # (replica id, policy, version): acknowledged, being pushed, last failed at
        self._acked: set[tuple[str, str, int]] = set()
        self._pushes: dict[tuple[str, str, int], asyncio.Task[None]] = {}
        self._failed_at: dict[tuple[str, str, int], float] = {}
        self._publish_lock = asyncio.Lock()

    def adapter_name(self, policy: str) -> str:
        return f"{self.run_id}/{policy}"

    # ------------------------------------------------------------------ run

    async def execute(self) -> None:
        sync = asyncio.create_task(self.sync_replicas())
        sync.add_done_callback(_log_crash)
        try:
            await self.train()
        finally:
            pushes = [sync, *self._pushes.values()]
            for task in pushes:
                task.cancel()
            await asyncio.gather(*pushes, return_exceptions=True)
            await replicas.retire_current(self.r, [self.adapter_name(p) for p in self.current])
            await self.release_adapters()

    async def train(self) -> None:
        from services.learner.policy import MultiAdapterPolicy

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
        await streams.ensure_group(self.r, self.rollouts_stream, LEARNER_GROUP)
        await streams.ensure_group(self.r, streams.TASKS, streams.WORKERS_GROUP)
        policy = await asyncio.to_thread(
            MultiAdapterPolicy,
            spec.model.path,
            self.policy_names,
            spec.lora,
            spec.optim,
            spec.train.steps,
            spec.model.dtype,
            spec.seed,
        )
        sampler = DataSampler(train, spec.seed)
        start_step = 0
        restored = await asyncio.to_thread(checkpoint.load_latest, self.out_dir, policy)
        if restored is not None:
            start_step = int(restored["step"])
            sampler.position = int(restored["data_position"])
            log.info("resumed %s at step %d", self.run_id, start_step)
        self.versions = dict.fromkeys(self.policy_names, start_step)
        await self.push(policy)
        if start_step == 0:
            await self.log_metrics({"step": 0, **await self.validate(val, 0)})
        for step in range(start_step, spec.train.steps):
            await self.check_cancel()
            t0 = time.monotonic()
            problems = sampler.next(spec.train.problems_per_step)
            rollouts = await self.run_tasks(problems, step, "train")
            t1 = time.monotonic()
            from services.learner.update import grpo_step

            ordered = sorted(rollouts.values(), key=lambda r: (r.problem_id, r.sample))
            metrics = await asyncio.to_thread(
                grpo_step, policy, ordered, [r.problem_id for r in ordered], self.roles, spec
            )
            t2 = time.monotonic()
            self.versions = dict.fromkeys(self.policy_names, step + 1)
            await self.push(policy)
            t3 = time.monotonic()
            done = step + 1
            self.log_rollouts(done, ordered)
            record: dict[str, Any] = {"step": done, **rollout_metrics(ordered), **metrics}
            if done % spec.train.val_interval == 0 or done == spec.train.steps:
                record.update(await self.validate(val, done))
            if done % spec.train.checkpoint_interval == 0 or done == spec.train.steps:
                await asyncio.to_thread(
                    checkpoint.save, self.out_dir, done, policy, {"data_position": sampler.position}
                )
            record.update(
                {
                    "time/rollout_s": t1 - t0,
                    "time/update_s": t2 - t1,
                    "time/push_s": t3 - t2,
                    "time/step_s": time.monotonic() - t0,
                    "alarms": [],
                }
            )
            await self.log_metrics(record)

    async def check_cancel(self) -> None:
        if await self.store.cancel_requested(self.run_id):
            raise RunCancelled()

    # ------------------------------------------------------------ episodes

    def make_task(self, problem: Problem, step: int, kind: str, sample: int) -> Task:
        spec = self.spec
        return Task(
            run_id=self.run_id,
            step=step,
            kind=kind,  # type: ignore[arg-type]
            problem=problem,
            sample=sample,
            workflow=spec.workflow,
            adapters={
                role: AdapterRef(self.adapter_name(p), self.versions[p])
                for role, p in self.roles.items()
            },
            model_path=spec.model.path,
            temperature=spec.sampling.temperature
            if kind == "train"
            else spec.sampling.val_temperature,
            top_p=spec.sampling.top_p,
            max_tokens=response_cap(spec),
            caps=spec.caps.model_dump(),
            format_penalty=spec.reward.format_penalty,
            math_timeout_s=spec.reward.math_timeout_s,
            seed=spec.seed,
        )

    async def run_tasks(self, problems: list[Problem], step: int, kind: str) -> dict[str, Rollout]:
        n = self.spec.grpo.group_size if kind == "train" else 1
        tasks = [self.make_task(p, step, kind, s) for p in problems for s in range(n)]
        expected = {t.id for t in tasks}
        ids = []
        async with self.r.pipeline(transaction=False) as pipe:
            for t in tasks:
                pipe.xadd(streams.TASKS, {"json": json.dumps(t.to_dict())})
            ids = await pipe.execute()
        try:
            return await self.collect(expected)
        finally:
            # every one of these was acknowledged (or this run is over): safe to delete
            await self.r.xdel(streams.TASKS, *ids)

    async def collect(self, expected: set[str]) -> dict[str, Rollout]:
        got: dict[str, Rollout] = {}
        deadline = time.monotonic() + self.spec.train.step_timeout_s
        while len(got) < len(expected):
            entries = await streams.read_group(
                self.r,
                self.rollouts_stream,
                LEARNER_GROUP,
                self.learner_id,
                count=1024,
                block_ms=500,
            )
            for e in entries:
                rollout = Rollout.from_dict(e.data)
                if rollout.task_id in expected and rollout.task_id not in got:
                    got[rollout.task_id] = rollout
            if entries:
                await streams.ack(
                    self.r, self.rollouts_stream, LEARNER_GROUP, *[e.id for e in entries]
                )
                await self.r.xdel(self.rollouts_stream, *[e.id for e in entries])
            else:
                await self.check_cancel()
            if time.monotonic() > deadline:
                raise RunFailed(
                    f"only {len(got)}/{len(expected)} rollouts arrived within "
                    f"train.step_timeout_s={self.spec.train.step_timeout_s:.0f}s; are workflow workers running?"
                )
        return got

    async def validate(self, val: list[Problem], step: int) -> dict[str, Any]:
        rollouts = list((await self.run_tasks(val, step, "val")).values())
        rewards = [min(max(r.reward, 0.0), 1.0) for r in rollouts]
        return {
            "val/accuracy": sum(rewards) / max(len(rewards), 1),
            "val/problems": len(rollouts),
            "val/episode_errors": sum(r.error is not None for r in rollouts),
        }

    # ------------------------------------------------------------ adapters

    async def push(self, policy: Any) -> None:
        """Publish the current version of every adapter, push it to every live replica and
        wait for all acks. Publishing first means a replica that joins meanwhile either is
        one of these targets or waits for this version before it serves."""
        current = {}
        for p in self.policy_names:
            state = await asyncio.to_thread(policy.state_dict, p)
            payload = await asyncio.to_thread(adapter_io.serialize, state)
            manifest = adapter_io.make_manifest(
                self.adapter_name(p),
                self.versions[p],
                self.base_model,
                self.spec.lora.rank,
                self.spec.lora.alpha,
                policy.target_modules(p),
                payload,
            )
            current[p] = Published(self.versions[p], manifest, payload)
        self.current = current
        await self.publish()
        targets = await self.replicas()
        results = await asyncio.gather(
            *(
                self._push_to(rid, info["address"], p)
                for rid, info in targets.items()
                for p in self.policy_names
                if (rid, p, self.versions[p]) not in self._acked
            ),
            return_exceptions=True,
        )
        unreachable = []
        for result in results:
            if isinstance(result, ReplicaUnreachable):
                unreachable.append(str(result))
            elif isinstance(result, BaseException):
                raise result
        for p in self.policy_names:
            if not any((rid, p, self.versions[p]) in self._acked for rid in targets):
                raise RunFailed(
                    f"no inference replica took {self.adapter_name(p)}@{self.versions[p]}: "
                    + "; ".join(unreachable)
                )

    async def publish(self) -> None:
        """Record (or refresh) the current versions in Redis; serialised so that a refresh
        taken before a new version was published cannot land after it."""
        async with self._publish_lock:
            versions = {self.adapter_name(p): pub.version for p, pub in self.current.items()}
            await replicas.publish_current(self.r, self.base_model, self.run_id, versions)

    def _push_to(self, rid: str, address: str, p: str) -> asyncio.Task[None]:
        """The push of p's current version to one replica; a push already under way (from a
        step or from the sync loop) is shared, not repeated."""
        pub = self.current[p]
        key = (rid, p, pub.version)
        task = self._pushes.get(key)
        if task is None:
            task = asyncio.create_task(self._push_one(rid, address, p, pub))
            self._pushes[key] = task

            def done(t: asyncio.Task[None]) -> None:
                del self._pushes[key]
                if not t.cancelled() and t.exception() is not None:
                    self._failed_at[key] = time.monotonic()
                    log.warning("%s", t.exception())

            task.add_done_callback(done)
        return task

    async def _push_one(self, rid: str, address: str, p: str, pub: Published) -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            try:
                await stub.PushAdapter(
                    adapter_io.chunks(pub.manifest, pub.payload), timeout=PUSH_DEADLINE_S
                )
            except grpc.aio.AioRpcError as err:
                ref = f"{self.adapter_name(p)}@{pub.version}"
                if err.code() in UNREACHABLE:
                    raise ReplicaUnreachable(
                        f"inference replica {rid} ({address}) unreachable for {ref}: "
                        f"{err.details()}"
                    ) from None
                raise RunFailed(
                    f"inference replica {rid} ({address}) refused adapter {ref}: {err.details()}"
                ) from None
        self._acked.add((rid, p, pub.version))
        await self.r.hset(f"marl:run:{self.run_id}:acks", f"{rid}/{p}@{pub.version}", time.time())

    async def release_adapters(self) -> None:
        """Unload this run's adapters from every live replica once the run is over (the
        checkpoints keep them), so a long-lived cluster does not grow with every run. A
        replica that cannot be reached is only logged: its memory dies with it."""
        names = {self.adapter_name(p) for p in self.policy_names}
        live = await replicas.live(self.r, "inference", include_joining=True)

        async def release(rid: str, address: str) -> None:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = inference_pb2_grpc.InferenceStub(channel)
                try:
                    listed = await stub.ListAdapters(
                        inference_pb2.ListAdaptersRequest(), timeout=RELEASE_DEADLINE_S
                    )
                    for loaded in listed.adapters:
                        if loaded.ref.name in names:
                            await stub.UnloadAdapter(
                                inference_pb2.UnloadAdapterRequest(ref=loaded.ref),
                                timeout=RELEASE_DEADLINE_S,
                            )
                except grpc.aio.AioRpcError as err:
                    if err.code() != grpc.StatusCode.NOT_FOUND:
                        log.warning("could not release %s's adapters on %s: %s",
                                    self.run_id, rid, err.details())

        await asyncio.gather(*(release(rid, info["address"]) for rid, info in live.items()))

    async def sync_replicas(self) -> None:
        """Keep the published versions fresh and push them to every live replica that has
        not acknowledged them: one that started mid-run waits for them before it serves."""
        while True:
            await asyncio.sleep(SYNC_INTERVAL_S)
            if not self.current:
                continue
            await self.publish()
            live = await replicas.live(self.r, "inference", include_joining=True)
            now = time.monotonic()
            for rid, info in live.items():
                if info.get("base_model") != self.base_model:
                    continue
                for p, pub in self.current.items():
                    key = (rid, p, pub.version)
                    failed_at = self._failed_at.get(key)
                    if key in self._acked or key in self._pushes:
                        continue
                    if failed_at is not None and now - failed_at < SYNC_RETRY_S:
                        continue
                    log.info("pushing %s@%d to replica %s", self.adapter_name(p), pub.version, rid)
                    self._push_to(rid, info["address"], p)

    async def replicas(self) -> dict[str, dict[str, Any]]:
        deadline = time.monotonic() + REPLICA_WAIT_S
        while True:
            live = await replicas.live(self.r, "inference", include_joining=True)
            matching = {k: v for k, v in live.items() if v.get("base_model") == self.base_model}
            if matching:
                return matching
            if time.monotonic() > deadline:
                seen = sorted({str(v.get("base_model")) for v in live.values()})
                raise RunFailed(
                    f"no live inference replica serves base model {self.base_model} "
                    f"(live replicas serve {seen or 'nothing'}); start one with the run's model.path"
                )
            await asyncio.sleep(1.0)

    # ------------------------------------------------------------- metrics

    def log_rollouts(self, step: int, rollouts: list[Rollout]) -> None:
        """A few whole transcripts per step, for reading what each role actually says."""
        n = self.spec.train.rollouts_logged
        if n == 0:
            return
        folder = self.out_dir / "rollouts"
        folder.mkdir(exist_ok=True)
        picked = rollouts[:: max(1, len(rollouts) // n)][:n]
        with open(folder / f"step_{step:06d}.jsonl", "w") as f:
            for r in picked:
                f.write(json.dumps(r.to_dict()) + "\n")

    async def log_metrics(self, record: dict[str, Any]) -> None:
        line = json.dumps(record)
        with open(self.out_dir / "metrics.jsonl", "a") as f:
            f.write(line + "\n")
        await self.store.update(self.run_id, step=record["step"], last_metrics_json=line)
        await self.r.xadd(streams.metrics_stream(self.run_id), {"json": line})


def _log_crash(task: asyncio.Task[None]) -> None:
    # Training goes on without the sync loop; replicas that start later serve once the
    # published versions expire, and workers fail over from them until a step's push.
    if not task.cancelled() and task.exception() is not None:
        log.error("adapter sync loop crashed", exc_info=task.exception())


def rollout_metrics(rollouts: list[Rollout]) -> dict[str, float]:
    """Outcome and per-role response shape of one step's rollouts."""
    from marl.rewards.math import last_boxed

    out: dict[str, float] = {}
    rewards = [r.reward for r in rollouts]
    out["train/reward_mean"] = sum(rewards) / max(len(rewards), 1)
    out["train/accuracy"] = sum(r >= 1.0 for r in rewards) / max(len(rewards), 1)
    out["train/episode_errors"] = sum(r.error is not None for r in rollouts)
    by_role: dict[str, list[Any]] = {}
    for r in rollouts:
        for t in r.turns:
            by_role.setdefault(t.role, []).append(t)
    for role, turns in by_role.items():
        lengths = sorted(len(t.completion_ids) for t in turns)
        out[f"role/{role}/response_len_mean"] = sum(lengths) / len(lengths)
        out[f"role/{role}/response_len_p50"] = lengths[len(lengths) // 2]
        out[f"role/{role}/response_len_p95"] = lengths[
            min(len(lengths) - 1, int(0.95 * len(lengths)))
        ]
        out[f"role/{role}/truncation_rate"] = sum(t.finish_reason == "length" for t in turns) / len(
            turns
        )
        out[f"role/{role}/boxed_rate"] = sum(last_boxed(t.text) is not None for t in turns) / len(
            turns
        )
    return out
