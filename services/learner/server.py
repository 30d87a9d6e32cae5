"""The learner process: the Runs API (gRPC) and the loop that trains queued runs, up to
`learner.max_concurrent_runs` at once.

Every run records the user who submitted it (`marl.runtime.auth.caller`); GetRun,
ListRuns, WatchRun and CancelRun show a user its own runs only, and another user's
run is NOT_FOUND with the very message of a run that does not exist."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import functools
import json
import logging
import math
import os
import uuid
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

import grpc
import redis.asyncio as aioredis

from marl.data import load_problems
from marl.models import names as model_names
from marl.models.identity import base_model_id
from marl.protocol.v1 import learner_pb2, learner_pb2_grpc
from marl.runtime import auth, replicas, streams
from marl.runtime.aio_tasks import cancel_until_done, raise_if_cancelled
from marl.runtime.heap import LEARNER_MMAP_THRESHOLD, keep_freed_heap_until_trimmed
from marl.runtime.http_server import HttpServer
from marl.runtime.metric_sinks import extra_sinks
from marl.runtime.serving import ServiceHost, configure_logging, serve_until_stopped
from marl.runtime.torch_thread import TorchThread
from marl.spec.run import RunSpec, SpecError, dump_spec, load_spec_text
from marl.spec.safe_input import shorten
from marl.spec.services import LearnerConfig
from marl.workflows import policy_of_role
from services.learner import intake
from services.learner.errors import RunCancelled, RunFailed, RunStopped
from services.learner.lease import Lease, LeaseLost
from services.learner.policy_pool import PolicyPool
from services.learner.runs import TERMINAL, Position, RunStore, new_run_id, owner_of
from services.learner.trainer import RunExecutor

log = logging.getLogger(__name__)

SWEEP_PERIOD_S = 60.0
"""How often a learner forgets the finished runs past their retention."""
DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
PAGE_BYTES = 3 << 20
"""A ListRuns page stops before its runs pass this many bytes (a client takes 4 MiB)."""
MAX_PAGE_TOKEN = 512


def _run_message(d: dict[str, Any]) -> learner_pb2.Run:
    return learner_pb2.Run(
        run_id=d["run_id"],
        state=d["state"],
        step=int(d.get("step") or 0),
        total_steps=int(d.get("total_steps") or 0),
        out_dir=d.get("out_dir", ""),
        error=d.get("error", ""),
        dead_lettered=int(d.get("dead_lettered") or 0),
        duplicate_rollouts=int(d.get("duplicate_rollouts") or 0),
        last_metrics_json=d.get("last_metrics_json", ""),
        created_at=float(d.get("created_at") or 0),
        spec_yaml=d.get("spec_yaml", ""),
        alarms=json.loads(d.get("alarms_json") or "[]"),
        episodes=int(d.get("episodes") or 0),
        failed_episodes=int(d.get("failed_episodes") or 0),
        failed_steps=int(d.get("failed_steps") or 0),
        steps_done=int(d.get("steps_done") or 0),
        owner=owner_of(d),
    )


def page_token(position: Position) -> str:
    """The token of the page after `position`: where the listing stands, nothing more (a
    forged one only moves where a caller's own listing starts)."""
    return base64.urlsafe_b64encode(json.dumps(list(position)).encode()).decode()


def page_position(token: str) -> Position | None:
    """The position a page token names (None: the first page); a ValueError for a token
    no learner gave."""
    if not token:
        return None
    problem = ValueError("page_token: not a token a learner gave; pass next_page_token back "
                         "as it came, or leave it empty for the first page")
    if len(token) > MAX_PAGE_TOKEN:
        raise problem
    try:
        score, run_id = json.loads(base64.urlsafe_b64decode(token.encode("ascii")))
    except (ValueError, TypeError, binascii.Error, UnicodeEncodeError):
        raise problem from None
    if (not isinstance(score, (int, float)) or isinstance(score, bool)
            or not math.isfinite(score) or not isinstance(run_id, str)):
        raise problem
    return float(score), run_id


def validate_spec(spec_yaml: str, cfg: LearnerConfig) -> RunSpec:
    """Everything a user can get wrong, and everything the operator does not let a spec
    name (services/learner/intake.py), checked before the run is accepted. Its `out_dir`,
    if set, comes back resolved."""
    from services.learner.option_checks import spec_problems

    intake.check_size(spec_yaml, cfg)
    spec = load_spec_text(spec_yaml)
    intake.check_code(spec, intake.code_policy(cfg))  # before anything is imported
    intake.check_judge(spec, cfg)
    intake.check_model_and_data(spec, cfg)
    if spec.out_dir:
        spec.out_dir = str(intake.check_out_dir(spec.out_dir, Path(cfg.runs_dir), cfg))
    spec_problems(spec, policy_of_role(spec))
    try:
        # a model name (`demo`, `smollm2`) becomes this learner's directory of that model,
        # which the accepted run's spec then records
        spec.model.path = model_names.resolve(spec.model.path)
        base_model_id(spec.model.path)
    except ValueError as err:
        raise SpecError(str(err)) from None
    if not 0 <= spec.seed <= MAX_SEED:
        raise SpecError(f"field `seed`: must be in 0..{MAX_SEED}, got {shorten(spec.seed)}")
    if spec.out_dir:
        out_dir_problem(spec.out_dir)
    missing = missing_lora_targets(spec.model.path, spec.lora.target_modules)
    if missing:
        raise SpecError(
            f"field `lora.target_modules`: {', '.join(shorten(m, 60) for m in missing[:5])} "
            f"name no layer of {shorten(spec.model.path)}; use layer names such as q_proj, "
            "v_proj, or `all-linear`"
        )
    device_problem(spec)
    for split in ("train", "val"):
        if not load_problems(spec.data, split, spec.seed):  # type: ignore[arg-type]
            raise SpecError(f"field `data.{split}`: the dataset has no problems")
    return spec


def device_problem(spec: RunSpec) -> None:
    """`learner.device` and `learner.world_size` against what this learner's torch sees."""
    import torch

    from services.learner.group import joined

    device, size = spec.learner.device, spec.learner.world_size
    launched = joined()
    if launched is not None:
        if size not in (1, launched.size):
            raise SpecError(
                f"field `learner.world_size`: this learner is one group of {launched.size} "
                f"ranks started by a launcher, and every run trains on all of them; set it "
                f"to 1 or {launched.size}"
            )
        return
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cuda" and gpus == 0:
        raise SpecError(
            "field `learner.device`: cuda, but the learner's torch sees no GPU; "
            "use cpu or auto"
        )
    if gpus and device != "cpu" and size > gpus:
        raise SpecError(
            f"field `learner.world_size`: {size} ranks need a GPU each, this learner has "
            f"{gpus}; lower it or set learner.device=cpu"
        )


MAX_SEED = (1 << 32) - 1
"""Seeds every library the run seeds (torch, numpy, vLLM, random) accepts."""


def out_dir_problem(out_dir: str) -> None:
    """A SpecError if the run could not create or write `out_dir`."""
    p = Path(out_dir).expanduser().absolute()
    if p.exists() and not p.is_dir():
        raise SpecError(f"field `out_dir`: {shorten(out_dir)} is a file; name a directory")
    ancestor = p
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise SpecError(
            f"field `out_dir`: {shorten(str(ancestor))} is a file, so "
            f"{shorten(out_dir)} cannot be created; name a directory"
        )
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise SpecError(f"field `out_dir`: the learner cannot write in {shorten(str(ancestor))}")


@functools.lru_cache(maxsize=16)
def _layer_names(model_path: str) -> tuple[str, ...]:
    """Names of the layers LoRA can adapt, from the model's config (no weights are loaded)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    kinds = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, Conv1D)
    return tuple(n for n, m in model.named_modules() if isinstance(m, kinds))


def missing_lora_targets(model_path: str, targets: list[str] | str) -> list[str]:
    """The entries of `lora.target_modules` that match no adaptable layer (as PEFT matches:
    the full name or its last dotted part)."""
    if isinstance(targets, str):  # `all-linear`
        return []
    names = _layer_names(str(Path(model_path).resolve()))
    return [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]


class LearnerService(learner_pb2_grpc.LearnerServicer):
    def __init__(self, r: aioredis.Redis, store: RunStore, runs_dir: Path, retention_s: float,
                 cfg: LearnerConfig | None = None):
        self.r = r
        self.store = store
        self.runs_dir = runs_dir
        self.retention_s = retention_s
        self.cfg = cfg if cfg is not None else LearnerConfig(runs_dir=str(runs_dir))

    async def SubmitRun(
        self, request: learner_pb2.SubmitRunRequest, context: grpc.aio.ServicerContext
    ) -> learner_pb2.SubmitRunResponse:
        try:
            spec = await asyncio.to_thread(validate_spec, request.spec_yaml, self.cfg)
        except SpecError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except (SystemExit, KeyboardInterrupt) as err:  # user code past every guard: still not ours
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the spec's workflow or reward code raised "
                                f"{type(err).__name__} while it was checked; fix that code")
        model = base_model_id(spec.model.path)
        live = await replicas.live(self.r, "inference", include_joining=True)
        if live and not any(v.get("base_model") == model for v in live.values()):
            served = sorted({str(v.get("base_model")) for v in live.values()})
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"field `model.path`: no inference replica serves {model} (they serve {served}); "
                "point model.path at the served model or start inference with this one",
            )
        run_id = new_run_id(spec.name)
        spec.out_dir = spec.out_dir or str(intake.real(self.runs_dir / run_id))
        holder = await self.store.claim_out_dir(spec.out_dir, run_id)
        if holder is not None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"field `out_dir`: run {holder} writes to {shorten(spec.out_dir)}; name a new "
                "directory (or leave out_dir unset)",
            )
        spec_text = await asyncio.to_thread(dump_spec, spec)
        owner = auth.caller().user
        await self.store.create(run_id, spec_text, spec.out_dir, spec.train.steps, owner=owner)
        log.info("accepted run %s of %s", run_id, owner)
        return learner_pb2.SubmitRunResponse(run_id=run_id)

    async def _get(self, run_id: str, context: grpc.aio.ServicerContext) -> dict[str, Any]:
        """The run, if it exists and the caller may see it; else NOT_FOUND, the same for a
        run of another user as for none at all."""
        run = await self.store.get(run_id) if run_id else None
        if run is not None and not auth.caller().may_see(owner_of(run)):
            run = None
        if run is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"run {run_id!r} does not exist; see `marl runs`"
            )
        assert run is not None
        return run

    async def GetRun(
        self, request: learner_pb2.GetRunRequest, context: grpc.aio.ServicerContext
    ) -> learner_pb2.Run:
        return _run_message(await self._get(request.run_id, context))

    async def ListRuns(
        self, request: learner_pb2.ListRunsRequest, context: grpc.aio.ServicerContext
    ) -> learner_pb2.ListRunsResponse:
        """One page of the runs the caller may see, oldest first."""
        size = request.page_size or DEFAULT_PAGE_SIZE
        try:
            if size < 0:
                raise ValueError(f"page_size: must be 0 (the default, {DEFAULT_PAGE_SIZE}) or "
                                 f"more, got {size}")
            after = page_position(request.page_token)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        size = min(size, MAX_PAGE_SIZE)
        runs: list[learner_pb2.Run] = []
        used = 0
        last: Position | None = None
        token = ""
        async for position, record in self.store.scan(after, auth.owner_filter()):
            message = _run_message(record)
            if runs and (len(runs) >= size or used + message.ByteSize() > PAGE_BYTES):
                assert last is not None
                token = page_token(last)  # a run follows: the next page starts after `last`
                break
            runs.append(message)
            used += message.ByteSize()
            last = position
        return learner_pb2.ListRunsResponse(runs=runs, next_page_token=token)

    async def CancelRun(
        self, request: learner_pb2.CancelRunRequest, context: grpc.aio.ServicerContext
    ) -> learner_pb2.Run:
        run = await self._get(request.run_id, context)
        if run["state"] in TERMINAL:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"run {request.run_id} already ended ({run['state']})",
            )
        await self.store.request_cancel(request.run_id)
        if run["state"] == "QUEUED":
            await self.store.r.lrem("marl:runs:queue", 0, request.run_id)
            await self.store.finish(request.run_id, "CANCELLED", self.retention_s)
        return _run_message(await self._get(request.run_id, context))

    async def WatchRun(
        self, request: learner_pb2.WatchRunRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[learner_pb2.RunEvent]:
        await self._get(request.run_id, context)
        stream = streams.metrics_stream(request.run_id)
        last = "0-0" if request.from_start else "$"
        if last == "$":
            info: Any = await self.r.xinfo_stream(stream) if await self.r.exists(stream) else None
            last = info["last-generated-id"] if info else "0-0"
        while True:
            resp: Any = await self.r.xread({stream: last}, count=100, block=500)
            run = await self._get(request.run_id, context)
            for _name, entries in resp or []:
                for entry_id, fields in entries:
                    last = entry_id
                    yield learner_pb2.RunEvent(metrics_json=fields["json"], run=_run_message(run))
            if not resp and run["state"] in TERMINAL:
                yield learner_pb2.RunEvent(run=_run_message(run))
                return


async def _next_run(store: RunStore, learner_id: str) -> tuple[str, int, Lease] | None:
    """A queued run, or a RUNNING one whose learner died (its lease lapsed): (run id, the
    number of times it has been taken over, the lease taken on it)."""
    run_id = await store.take_next(timeout_s=1.0)
    if run_id is not None:
        record = await store.get(run_id)
        if record is None or record["state"] != "QUEUED":
            return None
        taken = await store.claim(run_id, learner_id)
        if taken is None:
            return None
        return run_id, 0, Lease(store, run_id, *taken)
    for orphan in await store.orphaned():
        taken = await store.claim(orphan, learner_id)
        if taken is not None:
            log.info("taking over run %s: its learner stopped renewing its lease", orphan)
            return orphan, await store.count_takeover(orphan), Lease(store, orphan, *taken)
    return None


async def run_loop(
    r: aioredis.Redis, store: RunStore, learner_id: str, cfg: LearnerConfig,
    stop: asyncio.Event | None = None,
) -> None:
    """Take queued runs, and runs whose learner died, and train up to
    `cfg.max_concurrent_runs` of them at once, each in a task of its own (`train_run`); a
    run that ends has its Redis state expire after `cfg.retention_s` (0: kept).

    The runs share the process's torch thread, each through a `RunLane` (its own random
    generators), and its queue takes their calls in turn. A run's own failures end that run
    alone; what escapes `train_run` (Redis lost while a run's end is recorded) stops the
    loop as it did with one run at a time, and the runs it held are taken over from their
    checkpoints by the next learner.

    Once `stop` is set (SIGTERM) it takes no more runs; the runs under way checkpoint the
    step they are on and end (`RunExecutor.stop_here`), and then so does the loop."""
    from services.learner.run_lane import RunLane

    stop = stop or asyncio.Event()
    torch_thread = TorchThread("learner")
    # the burst takes the cores inference leaves idle once a run's rollouts are in; with
    # several runs one run's rollouts being in says nothing of the others' generation
    burst_threads = cfg.burst_threads if cfg.max_concurrent_runs == 1 else 0
    running: set[asyncio.Task[None]] = set()
    pool = PolicyPool(cfg.warm_policy_processes) if cfg.warm_policy_processes else None
    try:
        while not stop.is_set():
            raise_if_cancelled()  # a cancel that redis-py lost in `_next_run` (see aio_tasks)
            _reap(running)
            if len(running) >= cfg.max_concurrent_runs:
                await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                continue
            taken = await _next_run(store, learner_id)
            if taken is None:
                continue
            run_id, takeover, lease = taken
            lane = RunLane(torch_thread)
            running.add(
                asyncio.create_task(
                    train_run(
                        r, store, lease, cfg,
                        takeover=takeover, torch_thread=lane, burst_threads=burst_threads,
                        stop=stop, policy_pool=pool,
                    ),
                    name=f"run {run_id}",
                )
            )
        if running:
            log.info("stopping: %d runs checkpoint the step they are on", len(running))
            await asyncio.wait(running)
            _reap(running)
    finally:
        await cancel_until_done(running)
        if pool is not None:
            await asyncio.to_thread(pool.close)


def _reap(running: set[asyncio.Task[None]]) -> None:
    """Forget the runs' tasks that ended; one that raised raises here."""
    for task in [t for t in running if t.done()]:
        running.discard(task)
        task.result()


async def train_run(
    r: aioredis.Redis,
    store: RunStore,
    lease: Lease,
    cfg: LearnerConfig,
    takeover: int,
    torch_thread: TorchThread,
    burst_threads: int,
    stop: asyncio.Event | None = None,
    policy_pool: PolicyPool | None = None,
) -> None:
    """Train one run, whose lease this learner holds, to its end and record how it ended:
    SUCCEEDED, CANCELLED, or FAILED with its error (a bad spec, a failed run, a crash in its
    training). Its lease is kept while it trains and released after. A run whose lease
    was lost stops with nothing recorded: it is another learner's now."""
    retention_s = cfg.retention_s
    run_id = lease.run_id
    record = await store.get(run_id)
    assert record is not None
    await store.update(run_id, state="RUNNING")
    log.info("training run %s (fencing token %d)", run_id, lease.fence)
    keeper = asyncio.create_task(lease.keep())
    try:
        spec = await asyncio.to_thread(load_spec_text, record["spec_yaml"])
        out_dir = Path(record["out_dir"])
        sinks = extra_sinks(spec, out_dir, run_id)  # TensorBoard, W&B (`logging`)
        executor = RunExecutor(
            run_id,
            spec,
            out_dir,
            r,
            store,
            lease.holder,
            takeover=takeover,
            extra_sinks=sinks,
            learner=cfg.model_copy(update={"burst_threads": burst_threads}),
            torch_thread=torch_thread,
            owner=owner_of(record),
            lease=lease,
            stop=stop,
            policy_pool=policy_pool,
        )
        await _until_lost(executor.execute(), lease)
    except LeaseLost as err:
        log.error("stopped run %s: %s", run_id, err)
        return
    except RunStopped as err:  # its lease is released below: the next learner resumes it
        log.info("%s", err)
        return
    except RunCancelled:
        await store.finish(run_id, "CANCELLED", retention_s)
    except (RunFailed, SpecError) as err:
        await store.finish(run_id, "FAILED", retention_s, error=str(err))
    except Exception as err:
        if lease.lost is not None:  # what failed after the loss is the new holder's to redo
            log.error("stopped run %s after losing its lease: %s", run_id, err)
            return
        log.exception("run %s crashed", run_id)
        await store.finish(run_id, "FAILED", retention_s, error=f"{type(err).__name__}: {err}")
    else:
        await store.finish(run_id, "SUCCEEDED", retention_s)
    finally:
        await cancel_until_done([keeper])
        await store.release(run_id, lease.holder)
    final = await store.get(run_id)
    log.info("run %s ended: %s", run_id, final and final["state"])


async def _until_lost(work: Coroutine[Any, Any, None], lease: Lease) -> None:
    """Run `work` to its end, or cancel it as soon as the lease is found lost and raise
    LeaseLost: a learner that lost its run does not finish even the step it was on."""
    task = asyncio.create_task(work)
    lost = asyncio.create_task(lease.wait_lost())
    try:
        await asyncio.wait({task, lost}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            await cancel_until_done([task])
        await cancel_until_done([lost])
    if task.cancelled():  # by the loss
        lease.check_local()
    task.result()


async def sweep_loop(
    store: RunStore, period_s: float = SWEEP_PERIOD_S, stop: asyncio.Event | None = None
) -> None:
    """Forget finished runs whose retention passed (`RunStore.sweep`), every `period_s`;
    a Redis outage is waited out. Ends once `stop` is set."""
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    stop = stop or asyncio.Event()
    while not stop.is_set():
        try:
            if swept := await store.sweep():
                log.info("forgot %d finished runs past their retention", swept)
        except (RedisConnectionError, RedisTimeoutError) as err:
            raise_if_cancelled()
            log.warning("could not sweep finished runs: %s; retrying", err)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), period_s)


async def _serve(cfg: LearnerConfig, runs_dir: Path) -> None:
    name = learner_pb2.DESCRIPTOR.services_by_name["Learner"].full_name
    server = ServiceHost([name], cfg.host, cfg.port)
    http = None
    if cfg.http_port is not None:  # Prometheus /metrics
        http = HttpServer(cfg.host, cfg.http_port)
        await http.start()
    r = streams.connect(cfg.redis)
    store = RunStore(r)
    learner_pb2_grpc.add_LearnerServicer_to_server(
        LearnerService(r, store, runs_dir, cfg.retention_s, cfg), server.server
    )
    learner_id = f"learner-{uuid.uuid4().hex[:8]}"

    async def ready() -> None:
        await r.ping()

    async def loop() -> None:
        await run_loop(r, store, learner_id, cfg, server.stop_event)

    async def sweep() -> None:
        await sweep_loop(store, stop=server.stop_event)

    async def on_stop() -> None:
        if http is not None:
            await http.stop()
        await r.aclose()

    await serve_until_stopped(
        server, ready=ready, background=[loop, sweep], on_stop=on_stop, drain_s=cfg.drain_s
    )


def run(cfg: LearnerConfig) -> None:
    """Serve the Runs API and train the runs it takes until SIGTERM/SIGINT; blocking."""
    from services.learner import group

    configure_logging("learner")
    launched = group.join()  # one rank of a group a launcher started (torchrun, srun, pods)
    if launched is not None and launched.rank != 0:
        group.follow(launched)
        return
    keep_freed_heap_until_trimmed(LEARNER_MMAP_THRESHOLD)  # reused within a step, trimmed after
    try:
        asyncio.run(_serve(cfg, Path(cfg.runs_dir).resolve()))
    finally:
        if launched is not None:
            group.stop(launched)
