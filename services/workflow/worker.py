"""The worker loop: take tasks from Redis, run episodes, score them, return rollouts.

XREADGROUP a task -> run its workflow -> score the final answer -> XADD the
rollout -> XACK. Tasks a dead worker left pending are claimed after
`claim_idle_s`. An episode that could not run (see `could_not_run`: inference
unreachable, no replica, the sandbox down, a prompt over its cap) returns a
rollout with `error` set, which the learner leaves out of training, so a step
never waits for a task that cannot succeed. Any other exception is a bug: it
propagates and the task stays pending.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import grpc

from marl import auth, replicas, streams
from marl.config import SpecError, WorkflowCaps
from marl.rewards.code import SandboxFailure
from marl.rollout import Rollout, Task
from marl.v1 import inference_pb2_grpc
from marl.workflows import EpisodeError, Workflow, resolve
from services.workflow import openai_proxy
from services.workflow.episode import Episode, NoReplica

log = logging.getLogger(__name__)

UNREACHABLE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
)
"""gRPC codes of a service (inference, sandbox) that did not answer."""


def could_not_run(err: BaseException) -> bool:
    """Whether `err` means the episode could not run (not that marl has a bug)."""
    if isinstance(err, EpisodeError | SandboxFailure | SpecError):
        return True
    return isinstance(err, grpc.aio.AioRpcError) and err.code() in UNREACHABLE


class Stats:
    def __init__(self) -> None:
        self.done = 0
        self.failed = 0
        self.in_flight = 0
        self.total_seconds = 0.0


class EpisodeRunner:
    """Runs one task to a rollout; shared by the Redis loop and the RunEpisode RPC."""

    def __init__(self, redis: Any, worker_id: str, sandbox_address: str | None = None):
        self.redis = redis
        self.worker_id = worker_id
        self.sandbox_address = sandbox_address
        self.stats = Stats()
        self._tokenizers: dict[str, Any] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._replicas: list[str] = []
        self._replicas_at = 0.0
        self._replicas_lock = asyncio.Lock()
        self._sandbox: Any = None

    def tokenizer(self, model_path: str) -> Any:
        if model_path not in self._tokenizers:
            from transformers import AutoTokenizer

            # local files only: a model name must never make a worker reach out to a hub
            self._tokenizers[model_path] = AutoTokenizer.from_pretrained(
                model_path, local_files_only=True)
        return self._tokenizers[model_path]

    async def stubs(self) -> list[inference_pb2_grpc.InferenceStub]:
        async with self._replicas_lock:
            if time.monotonic() - self._replicas_at > replicas.HEARTBEAT_S or not self._replicas:
                live = await replicas.live(self.redis, "inference")
                self._replicas = sorted(info["address"] for info in live.values())
                self._replicas_at = time.monotonic()
        if not self._replicas:
            raise NoReplica("no live inference replica is registered in Redis")
        out = []
        for addr in self._replicas:
            if addr not in self._channels:
                self._channels[addr] = auth.aio_channel(addr)
            out.append(inference_pb2_grpc.InferenceStub(self._channels[addr]))
        return out

    def episode(self, task: Task, workflow: Workflow) -> Episode:
        caps = workflow.caps_for(WorkflowCaps(**task.caps), task.problem.task)

        async def oracle(answer: str) -> bool:
            return await self.score(task, answer) >= 1.0

        return Episode(task, self.tokenizer(task.model_path), [], caps, oracle)

    async def run(self, task: Task) -> Rollout:
        started = time.monotonic()
        self.stats.in_flight += 1
        episode: Episode | None = None
        try:
            workflow = resolve(task.workflow)
            episode = self.episode(task, workflow)
            episode.stubs = await self.stubs()
            final = await episode_run(workflow, episode, task)
            reward = await self.score(task, final)
            facts = {**episode.facts, **await self.scoring_facts(task, final)}
            error = None
        except Exception as err:
            if not could_not_run(err):
                raise
            log.warning("episode %s could not run: %s: %s", task.id, type(err).__name__, err)
            final, reward, error = "", 0.0, f"{type(err).__name__}: {err}"
            facts = {}
            self.stats.failed += 1
        finally:
            self.stats.in_flight -= 1
        seconds = time.monotonic() - started
        self.stats.done += 1
        self.stats.total_seconds += seconds
        return Rollout(
            task_id=task.id,
            run_id=task.run_id,
            step=task.step,
            kind=task.kind,
            problem_id=task.problem.id,
            sample=task.sample,
            turns=episode.turns if error is None and episode is not None else [],
            final_text=final,
            reward=reward,
            worker_id=self.worker_id,
            seconds=seconds,
            error=error,
            facts=facts,
        )

    async def score(self, task: Task, final: str) -> float:
        problem = task.problem
        if problem.task == "code":
            from marl.rewards import code

            return float(await code.score(final, problem.tests, self.sandbox()))
        from marl.rewards import math as math_reward

        return await math_reward.score_async(
            final, problem.answer, task.format_penalty, task.math_timeout_s
        )

    def sandbox(self) -> Any:
        """The worker's one sandbox client (one channel), made on first use."""
        if self.sandbox_address is None:
            raise EpisodeError("a code task needs a sandbox: start the worker with --sandbox ADDR")
        if self._sandbox is None:
            from marl.clients.sandbox import AsyncSandboxClient

            self._sandbox = AsyncSandboxClient(self.sandbox_address)
        return self._sandbox

    async def scoring_facts(self, task: Task, final: str) -> dict[str, float]:
        """Math: whether the final answer holds the right value in any format."""
        if task.problem.task == "code":
            return {}
        from marl.rewards import math as math_reward

        right = await asyncio.to_thread(
            math_reward.any_format_correct, final, task.problem.answer, task.math_timeout_s
        )
        return {"any_format_correct": float(right)}

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        if self._sandbox is not None:
            await self._sandbox.close()


async def episode_run(workflow: Workflow, episode: Episode, task: Task) -> str:
    """The workflow's final answer; a non-str answer is the workflow's bug."""
    try:
        final = await workflow.run(episode, task.problem)
    finally:  # a turn through the episode's OpenAI endpoint failed: judged as turn() errors are
        openai_proxy.raise_failure(episode)
    if not isinstance(final, str):
        raise TypeError(f"workflow {workflow.name!r} returned {type(final).__name__}, not str")
    return final


async def work_loop(
    runner: EpisodeRunner,
    concurrency: int = 512,
    claim_idle_s: float = 120.0,
) -> None:
    r = runner.redis
    await streams.ensure_group(r, streams.TASKS, streams.WORKERS_GROUP)
    running: set[asyncio.Task[None]] = set()

    async def handle(entry: streams.Entry) -> None:
        try:
            task = Task.from_dict(entry.data)
            rollout = await runner.run(task)
            await streams.add(r, streams.rollouts_stream(task.run_id), rollout.to_dict())
            await streams.ack(r, streams.TASKS, streams.WORKERS_GROUP, entry.id)
        except Exception:  # left pending: another delivery (or the dead-letter stream) follows
            log.exception("task entry %s not completed", entry.id)

    last_claim = time.monotonic()
    while True:
        free = min(concurrency - len(running), 64)
        if free <= 0:
            await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            continue
        entries: list[streams.Entry] = []
        if time.monotonic() - last_claim > claim_idle_s / 4:
            last_claim = time.monotonic()
            entries = await streams.claim_stale(
                r,
                streams.TASKS,
                streams.WORKERS_GROUP,
                runner.worker_id,
                int(claim_idle_s * 1000),
                count=free,
            )
        if not entries:
            entries = await streams.read_group(
                r, streams.TASKS, streams.WORKERS_GROUP, runner.worker_id, count=free, block_ms=500
            )
        for entry in entries:
            t = asyncio.create_task(handle(entry))
            running.add(t)
            t.add_done_callback(running.discard)
