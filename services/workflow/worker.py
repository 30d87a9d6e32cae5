"""The worker loop: take tasks from Redis, run episodes, score them, return rollouts.

XREADGROUP a task -> run its workflow -> score the final answer -> XADD the
rollout -> XACK. A worker keeps a heartbeat key alive (`heartbeat_ttl_s`); the
tasks of a worker whose key expired (a SIGKILLed pod) are claimed by another
within seconds, while a slow but live worker keeps its tasks until
`claim_idle_s` (the last resort for a hung one). A task whose handling raised is
released and retried elsewhere; one that failed `max_deliveries` times goes to
the dead-letter stream, and its run gets a rollout with `error` set
("dead-lettered ...") so the learner reports it and the step does not wait for
it. A task is dead-lettered for failing, not for outliving its workers: a delivery
to a worker that died holding the task, or that handed it back on a clean stop,
does not count toward `max_deliveries`; a poison task that kills every worker it
reaches is still dead-lettered, after `streams.MAX_HOLDER_DEATHS` such deaths
(marl/runtime/streams.py says how its companions are spared). Redis errors (a restart) are logged and retried with backoff. An episode that could not run (see `could_not_run`: inference
unreachable, no replica, the sandbox down, a prompt over its cap) returns a
rollout with `error` set, which the learner leaves out of training, so a step
never waits for a task that cannot succeed. Any other exception is a bug: it
is logged and the task retried (see above). A task its run took back (deleted from
the stream: the run ended) is acknowledged without a rollout: its episode is cancelled
wherever it is, its turns in flight with it (`stop_withdrawn`), and a rollout that
finishes first is not sent (`RolloutSender`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import random
import time
from collections.abc import Callable, Iterable
from typing import Any

import grpc
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from marl.protocol.rpc_codes import NO_ANSWER
from marl.protocol.v1 import inference_pb2_grpc
from marl.rewards import functions as reward_functions
from marl.rewards.code_scoring import SandboxFailure
from marl.rewards.functions import RewardError, Scored
from marl.rewards.spec_checks import check_judge_endpoint
from marl.rollout import Rollout, Task
from marl.runtime import auth, replicas, streams, tracing
from marl.runtime.aio_tasks import cancel_until_done, raise_if_cancelled
from marl.runtime.gc_pauses import freeze_long_lived
from marl.runtime.prometheus_metrics import TASKS_REFUSED
from marl.runtime.task_signing import PAYLOAD_FIELD, TaskSigner
from marl.spec.code_refs import CodePolicy
from marl.spec.run import SpecError, WorkflowCaps
from marl.spec.services import WorkflowConfig, env_name
from marl.workflows import EpisodeError, Workflow, resolve
from marl.workflows.registry import check as check_workflow
from services.workflow import openai_proxy
from services.workflow.episode_runtime import NONE_REGISTERED, Episode, NoReplica, Renders
from services.workflow.generate_batcher import BatchingStub
from services.workflow.rollout_sender import RolloutSender
from services.workflow.user_code import exit_error, running_user_code

log = logging.getLogger(__name__)


def could_not_run(err: BaseException) -> bool:
    """Whether `err` means the episode could not run (not that marl has a bug): a service
    that did not answer, or a sandbox still full after the client's `busy_wait_s`."""
    if isinstance(err, EpisodeError | SandboxFailure | SpecError | RewardError):
        return True
    return isinstance(err, grpc.aio.AioRpcError) and (
        err.code() in NO_ANSWER or err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    )


ALLOWED_MODULES = f"the workers' allowed_modules ({env_name('workflow', 'allowed_modules')})"
JUDGE_ENDPOINTS = f"the workers' judge_endpoints ({env_name('workflow', 'judge_endpoints')})"


REPLICA_CHANNEL_OPTIONS = [("grpc.max_reconnect_backoff_ms", 1000)]
MAX_CACHED_CAPS = 64
"""A channel to a replica that went away tries to reconnect at least once a second, so a
replica that restarts on its address takes turns within a second of coming back, not
after gRPC's default backoff (growing to 120 s while it was down)."""


class Stats:
    def __init__(self) -> None:
        self.done = 0
        self.failed = 0
        self.in_flight = 0
        self.total_seconds = 0.0
        self.withdrawn = 0
        """Episodes cut short, or rollouts not sent, because their run took the task back."""


class EpisodeRunner:
    """Runs one task to a rollout; shared by the Redis loop and the RunEpisode RPC."""

    def __init__(self, redis: Any, worker_id: str, sandbox_address: str | None = None, *,
                 replica_wait_s: float, judge_endpoints: Iterable[str],
                 code: CodePolicy | None = None):
        self.redis = redis
        self.code = code if code is not None else CodePolicy(setting=ALLOWED_MODULES)
        """The names a task may give for its workflow and reward function (re-checked on
        every task: a task is input from Redis)."""
        self.judge_endpoints = list(judge_endpoints)
        """The judge endpoints a task may name (the worker sends the judge's key there)."""
        self.replica_wait_s = replica_wait_s
        """How long a turn no replica takes waits for one (`Episode.replica_wait_s`)."""
        self.worker_id = worker_id
        self.sandbox_address = sandbox_address
        self.stats = Stats()
        self._tokenizers: dict[str, Any] = {}
        self._loading: dict[str, asyncio.Future[Any]] = {}
        self._preloaded: set[str] = set()
        self._renders: dict[str, Renders] = {}
        self._contexts: dict[str, int | None] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._batching: dict[str, BatchingStub] = {}
        self._replicas: list[str] = []
        self._replicas_at = 0.0
        self._refreshing: asyncio.Task[None] | None = None
        self._sandbox: Any = None
        self._caps: dict[str, WorkflowCaps] = {}
        """A task's `caps` (canonical JSON) -> them validated: a step's tasks carry their
        run's, and a validation per episode was a share of the step's critical path."""

    async def tokenizer(self, model_path: str) -> Any:
        """The model's tokenizer, loaded once per model directory in a thread. A real
        tokenizer takes seconds of CPU to load: on the event loop that would stall the
        heartbeat and every episode in flight. A run's first episodes all wait
        on one load, or find it done by `preload`; a load that fails is tried again by
        the next episode."""
        if model_path not in self._tokenizers:
            path = os.path.realpath(model_path)
            tokenizer = self._tokenizers.get(path)
            if tokenizer is None:
                tokenizer = await asyncio.shield(self._load(path))
            self._tokenizers[model_path] = tokenizer
        return self._tokenizers[model_path]

    def preload(self, paths: Iterable[str]) -> None:
        """Start loading the tokenizer of each model directory in `paths` that is not
        loaded yet, in the background, once per directory (an episode retries a failed
        one on demand)."""
        for path in paths:
            if path in self._tokenizers or path in self._preloaded:
                continue
            self._preloaded.add(path)

            def failed(done: asyncio.Future[Any], path: str = path) -> None:
                if not done.cancelled() and done.exception() is not None:
                    log.info("no tokenizer preloaded from %s (%s); episodes load their "
                             "task's model_path", path, done.exception())

            self._load(path).add_done_callback(failed)

    def _load(self, path: str) -> asyncio.Future[Any]:
        """The load of `path`'s tokenizer in progress, started if none is."""
        loading = self._loading.get(path)
        if loading is None:
            loading = asyncio.ensure_future(asyncio.to_thread(load_tokenizer, path))
            self._loading[path] = loading

            def loaded(done: asyncio.Future[Any]) -> None:
                del self._loading[path]
                if not done.cancelled() and done.exception() is None:
                    self._tokenizers[path] = done.result()

            loading.add_done_callback(loaded)
        return loading

    def context(self, model_path: str) -> int | None:
        """The model's context window, from its config.json (None if it has none to read)."""
        if model_path not in self._contexts:
            from marl.models.limits import model_limits

            try:
                self._contexts[model_path] = model_limits(model_path).context
            except ValueError:
                self._contexts[model_path] = None
        return self._contexts[model_path]

    async def stubs(self, fresh: bool = False) -> list[BatchingStub]:
        """One Generate per live replica; a replica's concurrent calls go as one.

        The live replicas are read from Redis at most once per heartbeat, or at once when
        `fresh` (for a turn that every listed replica turned away: the list may miss one
        that turned serving since), by one shared refresh that every episode asking
        meanwhile awaits. They all resume in the same
        turn of the event loop and reach `Generate` together, so their turns go out as
        one GenerateMany (a lock would hand them on one per loop turn, a call each)."""
        if fresh or self.replicas_age() > replicas.HEARTBEAT_S or not self._replicas:
            await self.refresh_replicas()
        if not self._replicas:
            raise NoReplica(NONE_REGISTERED)
        out = []
        for addr in self._replicas:
            if addr not in self._channels:
                self._channels[addr] = auth.aio_channel(addr, REPLICA_CHANNEL_OPTIONS)
                stub = inference_pb2_grpc.InferenceStub(self._channels[addr])
                self._batching[addr] = BatchingStub(stub)
            out.append(self._batching[addr])
        return out

    def replicas_age(self) -> float:
        """Seconds since the replica registry was last read."""
        return time.monotonic() - self._replicas_at

    async def refresh_replicas(self) -> None:
        """Read the replica registry once for every caller asking meanwhile (its error
        reaches each of them)."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.create_task(self._refresh_replicas())
        await asyncio.shield(self._refreshing)

    async def _refresh_replicas(self) -> None:
        """The serving replicas to route to; every announced model's tokenizer, joining
        replicas' too, to `preload`."""
        live = await replicas.live(self.redis, "inference", include_joining=True)
        self._replicas = sorted(
            info["address"] for info in live.values() if info.get("serving", True)
        )
        self._replicas_at = time.monotonic()
        self.preload(str(info["model_path"]) for info in live.values() if info.get("model_path"))

    async def episode(self, task: Task, workflow: Workflow) -> Episode:
        caps = workflow.caps_for(self.workflow_caps(task.caps), task.problem.task)
        args = workflow.parse_args(task.workflow_args)

        async def oracle(answer: str) -> bool:  # facts only: never asks (and records) a judge
            name = task.reward_function or reward_functions.default_for(task.problem.task)
            scored = await reward_functions.call(name, task.problem, answer, episode,
                                                 task.reward_args)
            return scored.score >= 1.0

        tokenizer = await self.tokenizer(task.model_path)
        if task.model_path not in self._renders:
            self._renders[task.model_path] = Renders(tokenizer)
        episode = Episode(task, tokenizer, [], caps, oracle, self._renders[task.model_path])
        episode.context = self.context(task.model_path)
        episode.args = args
        episode.sandbox_client = self.sandbox
        episode.judge_client = self.judge_client
        return episode

    def workflow_caps(self, caps: dict[str, Any]) -> WorkflowCaps:
        """`caps` validated (a ValidationError as before), once per distinct value while
        at most MAX_CACHED_CAPS are held."""
        key = json.dumps(caps, sort_keys=True)
        valid = self._caps.get(key)
        if valid is None:
            valid = WorkflowCaps(**caps)
            if len(self._caps) >= MAX_CACHED_CAPS:
                self._caps.clear()
            self._caps[key] = valid
        return valid

    def check_names(self, task: Task) -> None:
        """The task's workflow, reward function and judge endpoint are ones this worker's
        operator allows (`allowed_modules`, `judge_endpoints`); a SpecError if not."""
        check_workflow(task.workflow, self.code)
        if task.reward_function:
            reward_functions.check_name(task.reward_function, self.code)
        endpoint = (task.judge or {}).get("endpoint")
        if endpoint:
            check_judge_endpoint(str(endpoint), self.judge_endpoints, JUDGE_ENDPOINTS)

    async def run(self, task: Task) -> Rollout:
        with running_user_code():
            return await self._run(task)

    async def _run(self, task: Task) -> Rollout:  # noqa: C901 - one episode, top to bottom
        started = time.monotonic()
        self.stats.in_flight += 1
        episode: Episode | None = None
        try:
            self.check_names(task)
            workflow = resolve(task.workflow)
            episode = await self.episode(task, workflow)
            try:
                episode.stubs = await self.stubs()
            except NoReplica:
                if self.replica_wait_s <= 0:
                    raise
                episode.stubs = []  # its first turn waits for one (Episode.replica_wait_s)
            episode.restub = functools.partial(self.stubs, fresh=True)
            episode.replica_wait_s = self.replica_wait_s
            final = await episode_run(workflow, episode, task)
            with tracing.span("score", "score", task=task.id):
                scored = await self.scored(task, final, episode)
            reward = scored.score
            facts = {**episode.facts, **scored.components, **tool_facts(episode)}
            role_rewards = {**episode.role_rewards, **scored.role_rewards}
            error = None
        except (Exception, SystemExit, KeyboardInterrupt) as raised:
            exited = isinstance(raised, SystemExit | KeyboardInterrupt)
            err = exit_error(raised) if exited else raised
            if not could_not_run(err):
                raise
            log.warning("episode %s could not run: %s: %s", task.id, type(err).__name__, err)
            final, reward, error = "", 0.0, f"{type(err).__name__}: {err}"
            facts, role_rewards = {}, {}
            self.stats.failed += 1
        finally:
            self.stats.in_flight -= 1
        seconds = time.monotonic() - started
        tracing.add("episode", started, started + seconds, "episodes", task=task.id, error=error)
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
            role_rewards=role_rewards,
            judge_turns=list(episode.judge_turns) if error is None and episode else [],
        )

    async def score(self, task: Task, final: str) -> float:
        """The reward of `final` alone (no episode: the function sees no turns)."""
        return (await self.scored(task, final, None)).score

    async def scored(self, task: Task, final: str, episode: Episode | None) -> Scored:
        """The run's reward function on the episode's final answer: `reward.function`, else
        the judge's with `reward.judge`, else the built-in reward of the problem's task."""
        name = task.reward_function or (
            reward_functions.BUILTIN_JUDGE if task.judge is not None
            else reward_functions.default_for(task.problem.task))
        view: Any = episode if episode is not None else Scoring(task, self.sandbox)
        return await reward_functions.call(name, task.problem, final, view, task.reward_args)

    async def judge_client(self, task: Task) -> Any:
        """The OpenAI-compatible endpoint the run's judge is asked through (judge_client.py)."""
        from services.workflow.judge_client import endpoint_for

        return await endpoint_for(self, task)

    def sandbox(self) -> Any:
        """The worker's one sandbox client (one channel), made on first use."""
        if self.sandbox_address is None:
            raise EpisodeError("a code task needs a sandbox: start the worker with --sandbox ADDR")
        if self._sandbox is None:
            from marl.clients.sandbox import AsyncSandboxClient

            self._sandbox = AsyncSandboxClient(self.sandbox_address)
        return self._sandbox

    async def close(self) -> None:
        if self._refreshing is not None:
            await cancel_until_done([self._refreshing])
        for batching in self._batching.values():
            await batching.close()
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


class Scoring:
    """What a reward function sees of an episode when it scores an answer alone."""

    def __init__(self, task: Task, sandbox: Callable[[], Any]):
        self.task = task
        self.sandbox = sandbox
        self.turns: list[Any] = []
        self.facts: dict[str, float] = {}


def tool_facts(episode: Episode) -> dict[str, float]:
    """`role/<r>/tool_calls` and `role/<r>/tool_errors` of the roles that offered tools:
    their calls (answered with an error) this episode."""
    out: dict[str, float] = {}
    for turn in episode.turns:
        if turn.role in episode.tool_roles:
            calls = f"role/{turn.role}/tool_calls"
            errors = f"role/{turn.role}/tool_errors"
            out[calls] = out.get(calls, 0.0) + turn.tool_calls
            out[errors] = out.get(errors, 0.0) + turn.tool_errors
    return out


REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, OSError)

TASKS_PER_READ = 512
"""The most tasks one stream read takes (within `concurrency`). A step's tasks are queued
at once; read together, their first turns reach an inference replica as one GenerateMany
burst and prefill as one batch, where reads of 64 split a demo step into two waves."""
"""Errors of a Redis that is unreachable (restarting): retried with backoff."""


async def heartbeat(r: Any, worker_id: str, ttl_s: float) -> None:
    """Keep `worker_id`'s liveness key; a Redis outage is waited out, not fatal."""
    while True:
        try:
            await streams.beat(r, worker_id, ttl_s)
        except REDIS_DOWN as err:
            raise_if_cancelled()  # redis-py can turn a cancelled command into ConnectionError
            log.warning("heartbeat: redis unreachable (%s); retrying", err)
        raise_if_cancelled()
        await asyncio.sleep(min(1.0, ttl_s / 4))


async def preload_served_tokenizers(runner: EpisodeRunner, period_s: float) -> None:
    """Keep `runner`'s replica list no older than `period_s` while no episode asks for it,
    so every model a replica announces (a joining one too) has its tokenizer loaded
    before a run's first episodes: the load (once per model and worker) runs while the worker waits for work, not inside a run's first step.
    Episodes share the same reads (`EpisodeRunner.stubs`)."""
    while True:
        age = runner.replicas_age()
        if age < period_s:
            await asyncio.sleep(period_s - age)
            continue
        try:
            await runner.refresh_replicas()
        except REDIS_DOWN:
            raise_if_cancelled()  # the heartbeat logs the outage
            await asyncio.sleep(period_s)


WITHDRAWN_CHECK_S = 1.0
"""How often a worker asks which of its tasks their runs took back (`stop_withdrawn`)."""


async def stop_withdrawn(
    r: Any, held: dict[str, tuple[float, asyncio.Task[None]]], withdrawn: set[str],
    period_s: float = WITHDRAWN_CHECK_S,
) -> None:
    """Every `period_s`, cancel the episodes whose task entry is gone from the tasks stream,
    adding their entry ids to `withdrawn`. The learner deletes the tasks of a run that
    ended (cancelled, failed) and of a step it trained without this copy: nobody will
    read such a rollout, and its turns would hold the replica (a real model's turn runs
    for minutes; a cancelled Generate's rows are dropped, `BatchingStub`). `held`: entry id
    -> (when the worker took it, the task handling it). One round trip a check, for the
    tasks held at least `period_s`: an episode shorter than that is never asked about."""
    while True:
        await asyncio.sleep(period_s)
        now = time.monotonic()
        ids = [i for i, (since, _) in held.items() if now - since >= period_s and i not in withdrawn]
        if not ids:
            continue
        try:
            gone = await streams.missing(r, streams.TASKS, ids)
        except REDIS_DOWN:
            raise_if_cancelled()  # the heartbeat logs the outage
            continue
        for entry_id in gone:
            if entry_id in held:
                withdrawn.add(entry_id)
                held[entry_id][1].cancel()


def dead_rollout(entry: streams.Entry, worker_id: str) -> Rollout:
    """The rollout a dead-lettered task's run gets instead of one from its episode."""
    task = Task.from_dict(entry.data)
    return Rollout(
        task_id=task.id,
        run_id=task.run_id,
        step=task.step,
        kind=task.kind,
        problem_id=task.problem.id,
        sample=task.sample,
        turns=[],
        final_text="",
        reward=0.0,
        worker_id=worker_id,
        seconds=0.0,
        error=f"{streams.DEAD_LETTERED} {entry.why_dead()}",
        facts={},
    )


def load_tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    # local files only: a model name must never make a worker reach out to a hub
    return AutoTokenizer.from_pretrained(model_path, local_files_only=True)


def import_tokenizers() -> None:
    """Import transformers' tokenizer classes: seconds of CPU, which an episode's first
    tokenizer load would otherwise spend on the event loop, stalling the heartbeat (TTL
    5 s) and every other episode. The load itself then takes milliseconds. Not in the
    server's `ready` (with the math verifier's warm-up): the worker would report SERVING
    that much later, and a replacement for a lost worker would join that much later."""
    from transformers import AutoTokenizer  # noqa: F401


async def work_loop(  # noqa: C901, PLR0915 (older than the limit; split it when next changed)
    runner: EpisodeRunner,
    cfg: WorkflowConfig,
    stopping: Callable[[], bool] = lambda: False,
    signer: TaskSigner | None = None,
) -> None:
    """Run tasks from the stream until cancelled, or until `stopping()`: then take no new
    task, let the episodes under way finish for up to `cfg.drain_s` (their rollouts are
    sent), and hand back what is left at once (another worker claims it without waiting).
    `cfg`'s concurrency, heartbeat, claim and delivery settings shape the loop. With a
    `signer` holding the services' token, an entry without its valid signature is refused
    (`refuse`): never run, nor dead-lettered as a failed episode of a run."""
    concurrency, drain_s = cfg.concurrency, cfg.drain_s
    claim_idle_s, heartbeat_ttl_s = cfg.claim_idle_s, cfg.heartbeat_ttl_s
    max_deliveries = cfg.max_deliveries
    r = runner.redis
    worker_id = runner.worker_id
    running: set[asyncio.Task[None]] = set()
    held: dict[str, tuple[float, asyncio.Task[None]]] = {}
    withdrawn: set[str] = set()
    sender = RolloutSender(r)
    signer = signer or TaskSigner(None)

    async def handle(entry: streams.Entry) -> None:
        try:
            task = Task.from_dict(entry.data)
            rollout = await runner.run(task)
            if not await sender.send(rollout, entry.id):
                runner.stats.withdrawn += 1
        except asyncio.CancelledError:
            if entry.id not in withdrawn:
                raise
            await taken_back(entry.id)
        except Exception:
            if entry.id in withdrawn:  # redis-py can turn a cancel into ConnectionError
                await taken_back(entry.id)
                return
            log.exception("task entry %s not completed; releasing it for a retry", entry.id)
            try:
                await streams.release(r, streams.TASKS, streams.WORKERS_GROUP, entry.id)
            except REDIS_DOWN:  # still ours; claimed once this worker is gone or hung
                log.warning("could not release task entry %s: redis unreachable", entry.id)

    async def refuse(entry: streams.Entry, reason: str) -> None:
        """A task entry no holder of the services' token queued: counted, logged and
        acknowledged (and deleted: no producer will), never run."""
        TASKS_REFUSED.labels(reason).inc()
        log.warning("refused task entry %s (%s): not signed with the services' token, so "
                    "not queued by a learner; not run. Its payload: %.300s", entry.id,
                    reason, entry.fields.get(PAYLOAD_FIELD, ""))
        try:
            await streams.ack(r, streams.TASKS, streams.WORKERS_GROUP, entry.id, delete=True)
        except REDIS_DOWN:  # still ours: refused again when claimed
            log.warning("could not acknowledge refused task entry %s: redis unreachable",
                        entry.id)

    async def on_dead(entry: streams.Entry) -> None:
        if (reason := signer.refusal(streams.TASKS, entry.fields)) is not None:
            TASKS_REFUSED.labels(reason).inc()
            log.warning("dead-lettered entry %s is no signed task (%s): no run is told",
                        entry.id, reason)
            return
        try:
            rollout = dead_rollout(entry, worker_id)
        except (ValueError, TypeError, KeyError) as err:  # not a task: nobody waits for it
            log.error("dead-lettered entry %s is no task: %s", entry.id, err)
            return
        log.error("task %s dead-lettered %s", rollout.task_id, entry.why_dead())
        await streams.add(r, streams.rollouts_stream(rollout.run_id), rollout.to_dict())

    async def taken_back(entry_id: str) -> None:
        """Acknowledge the entry of an episode `stop_withdrawn` cancelled; send nothing."""
        this = asyncio.current_task()
        if this is not None and this.cancelling():
            this.uncancel()
        runner.stats.withdrawn += 1
        log.info("task entry %s was taken back by its run; its episode stopped, no rollout "
                 "sent", entry_id)
        try:
            await streams.ack(r, streams.TASKS, streams.WORKERS_GROUP, entry_id)
        except REDIS_DOWN:  # a deleted entry left pending is acknowledged by a claim
            pass

    def let_go(entry_id: str, done: asyncio.Task[None]) -> None:
        if entry_id in held and held[entry_id][1] is done:
            del held[entry_id]
            withdrawn.discard(entry_id)

    last_dead_check = last_stale_check = last_forget = time.monotonic()

    async def claim(free: int) -> list[streams.Entry]:
        nonlocal last_dead_check, last_stale_check, last_forget
        now = time.monotonic()
        entries: list[streams.Entry] = []
        if now - last_dead_check >= min(1.0, heartbeat_ttl_s / 4):
            last_dead_check = now
            entries = await streams.claim_dead(
                r, streams.TASKS, streams.WORKERS_GROUP, worker_id, count=free,
                max_deliveries=max_deliveries, on_dead=on_dead,
            )
        if not entries and now - last_stale_check > claim_idle_s / 4:
            last_stale_check = now
            entries = await streams.claim_stale(
                r, streams.TASKS, streams.WORKERS_GROUP, worker_id, int(claim_idle_s * 1000),
                count=free, max_deliveries=max_deliveries, on_dead=on_dead,
            )
        if now - last_forget > 30.0:
            last_forget = now
            await streams.forget_dead_consumers(r, streams.TASKS, streams.WORKERS_GROUP)
        return entries

    await streams.beat(r, worker_id, heartbeat_ttl_s)  # alive before it holds anything
    background = [asyncio.create_task(heartbeat(r, worker_id, heartbeat_ttl_s))]
    backoff = 0.1
    try:
        await streams.ensure_group(r, streams.TASKS, streams.WORKERS_GROUP)
        # before the first read: a worker takes no task it cannot start yet
        await asyncio.to_thread(import_tokenizers)
        freeze_long_lived()  # the tokenizer classes' modules, most of a worker's objects
        background.append(
            asyncio.create_task(preload_served_tokenizers(runner, replicas.HEARTBEAT_S))
        )
        background.append(asyncio.create_task(stop_withdrawn(r, held, withdrawn)))
        log.info("%s reading tasks from %s (up to %d at once)", worker_id, streams.TASKS, concurrency)
        while not stopping():
            raise_if_cancelled()  # a cancel that redis-py lost mid-command (see aio_tasks)
            free = min(concurrency - len(running), TASKS_PER_READ)
            if free <= 0:
                await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                continue
            try:
                entries = await claim(free)
                if not entries:
                    entries = await streams.read_group(
                        r, streams.TASKS, streams.WORKERS_GROUP, worker_id, count=free,
                        block_ms=500,
                    )
            except REDIS_DOWN as err:
                raise_if_cancelled()  # redis-py can turn a cancelled read into ConnectionError
                log.warning("redis unreachable (%s); retrying in %.1fs", err, backoff)
                await asyncio.sleep(backoff * (0.5 + random.random()))
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.1
            for entry in entries:
                if (reason := signer.refusal(streams.TASKS, entry.fields)) is not None:
                    await refuse(entry, reason)
                    continue
                t = asyncio.create_task(handle(entry))
                running.add(t)
                t.add_done_callback(running.discard)
                held[entry.id] = (time.monotonic(), t)
                t.add_done_callback(functools.partial(let_go, entry.id))
        if running:
            log.info("stopping: draining %d episodes (up to %.0fs)", len(running), drain_s)
            _, left = await asyncio.wait(running, timeout=drain_s)
            log.info("drained; %d episodes handed back", len(left))
    finally:
        for t in list(running):
            t.cancel()
        await cancel_until_done(background)
        try:  # a clean stop: what this worker held is claimable at once, its delivery excused
            await asyncio.wait_for(
                streams.hand_back(r, streams.TASKS, streams.WORKERS_GROUP, worker_id), 2.0
            )
        except (TimeoutError, *REDIS_DOWN):
            pass
        try:
            await asyncio.wait_for(streams.forget(r, worker_id), 2.0)
        except (TimeoutError, *REDIS_DOWN):
            pass
