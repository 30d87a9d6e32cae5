"""The Inference gRPC service: multi-LoRA generation and the adapter push protocol.

A replica reports SERVING only once it holds the current version of every adapter
an active run uses (see `marl.runtime.replicas`): one that starts mid-run announces
itself as joining, takes the learner's pushes, and only then takes requests.
With an HTTP port, the same engine also answers OpenAI's `/v1` API (`openai_api`).
With authentication on, a user's call sees only the adapters of its own runs (each
version's owner comes with its push, which only the services may make): another
user's adapter fails as one never pushed (`AdapterRegistry.acquire`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from marl.models import names as model_names
from marl.models.limits import ModelLimits, model_limits
from marl.protocol import adapter_io
from marl.protocol.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from marl.runtime import auth, replicas, streams, tracing
from marl.runtime.aio_tasks import cancel_until_done
from marl.runtime.fences import PushFences
from marl.runtime.heap import keep_freed_heap_until_trimmed
from marl.runtime.http_server import HttpServer
from marl.runtime.prometheus_metrics import ADAPTER_VERSIONS, INFERENCE_IN_FLIGHT
from marl.runtime.serving import (
    ServiceHost,
    bounded,
    configure_logging,
    serve_until_stopped,
    unexpected_details,
)
from marl.spec.services import InferenceConfig
from services.inference.adapters import (
    MAX_KEEP_VERSIONS,
    AdapterNotLoaded,
    AdapterRegistry,
    LoadedVersion,
    adapter_key,
)
from services.inference.engine import (
    AdapterWeights,
    Engine,
    GenerationRequest,
    check_request,
    room,
)
from services.inference.factory import make_engine
from services.inference.push_guard import PushBudget, PushRefused, check_owner

log = logging.getLogger(__name__)

MAX_ADAPTER_BYTES = 4 << 30
MAX_OWNER = 256
"""A user name's bound (marl.spec.users)."""
DEFAULT_MAX_PUSHES = 16
"""Pushes a replica built without a config buffers at once (`max_concurrent_pushes`)."""
MAX_REQUEST_ID = 4096
"""request_id carries the task id (run, step, problem id, role): long problem ids must fit."""
JOIN_CHECK_S = 0.5
PUBLISHED_WAIT_S = 30.0
"""How long a request waits for an adapter version its run's learner has published and is
pushing (`InferenceService._acquire`); after it, FAILED_PRECONDITION sends the turn on to
another replica."""
MAX_GENERATE_MANY = 4096
"""Requests in one GenerateMany call (a worker sends what its episodes asked for at once)."""
GENERATE_MANY_MESSAGE_BYTES = 4 << 20
"""A GenerateMany reply message takes outcomes done together until it holds this many
bytes, far inside gRPC's message limit (long answers of a big batch finish together)."""


class Refused(Exception):
    """A generation request the caller got wrong, with the gRPC code it fails with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class InferenceService(inference_pb2_grpc.InferenceServicer):
    """Registered before the server starts; `attach` brings the engine once it is built."""

    def __init__(
        self,
        replica_id: str,
        limits: ModelLimits,
        redis_client: aioredis.Redis | None = None,
        budget: PushBudget | None = None,
    ):
        """`redis_client`: where the runs' fencing tokens are read (None: only the tokens
        this replica saw pushed count); `budget`: the pushes it buffers at once."""
        self.replica_id = replica_id
        self.limits = limits
        self.redis = redis_client
        self.fences = PushFences()
        self.budget = budget or PushBudget(DEFAULT_MAX_PUSHES, MAX_ADAPTER_BYTES)
        self._engine: Engine | None = None
        self._registry: AdapterRegistry | None = None
        self._push_lock = asyncio.Lock()
        self.joined = False
        """Holds every adapter version an active run needs (`await_current_adapters`
        returned). Until then a request for a version it lacks is UNAVAILABLE, as from a
        replica not up yet, since the learner's push is on its way: a worker waiting for
        the only replica to come back waits on. After it, FAILED_PRECONDITION: no push
        will bring that version."""

    def attach(self, engine: Engine, registry: AdapterRegistry) -> None:
        self._engine, self._registry = engine, registry

    @property
    def engine_or_none(self) -> Engine | None:
        """The engine once attached (other front ends check before calling `engine`)."""
        return self._engine

    @property
    def engine(self) -> Engine:
        assert self._engine is not None, "engine not attached"
        return self._engine

    @property
    def registry(self) -> AdapterRegistry:
        assert self._registry is not None, "engine not attached"
        return self._registry

    async def _require_ready(self, context: grpc.aio.ServicerContext) -> None:
        if self._engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is still loading; retry")

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.GenerateResponse:
        await self._require_ready(context)
        try:
            return await self._generate(request)
        except Refused as err:
            await context.abort(err.code, err.message)
            raise AssertionError("context.abort returned") from err

    async def GenerateMany(
        self, request: inference_pb2.GenerateManyRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateManyResponse]:
        """Each request as Generate would serve it, all at once: an outcome goes back as
        soon as its request is done, and outcomes done in the same turn of the event loop
        share a message. One call in place of many saves a worker's episodes most of
        gRPC's per-call cost (bench/e2e.py)."""
        await self._require_ready(context)
        n = len(request.requests)
        if n > MAX_GENERATE_MANY:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"requests: at most {MAX_GENERATE_MANY} per call, got {n}")
        done: asyncio.Queue[inference_pb2.GenerateOutcome] = asyncio.Queue()

        client = context.peer() or ""

        async def one(index: int, req: inference_pb2.GenerateRequest) -> None:
            try:
                response = await self._generate(req, client)
            except Refused as err:
                outcome = inference_pb2.GenerateOutcome(
                    index=index, code=err.code.value[0], error=bounded(err.message) or "")
            except Exception as err:  # fails its request alone, as Generate would fail it
                log.error("unexpected error in request %d of a GenerateMany", index,
                          exc_info=err)
                outcome = inference_pb2.GenerateOutcome(
                    index=index, code=grpc.StatusCode.UNKNOWN.value[0],
                    error=unexpected_details(err))
            else:
                outcome = inference_pb2.GenerateOutcome(index=index, response=response)
            done.put_nowait(outcome)

        started = time.monotonic()
        tasks = [asyncio.create_task(one(i, r)) for i, r in enumerate(request.requests)]
        try:
            sent = 0
            while sent < n:
                outcomes = [await done.get()]
                size = outcomes[0].ByteSize()
                await asyncio.sleep(0)  # the rest of a decode step's rows settle meanwhile
                while not done.empty() and size < GENERATE_MANY_MESSAGE_BYTES:
                    outcomes.append(done.get_nowait())
                    size += outcomes[-1].ByteSize()
                sent += len(outcomes)
                yield inference_pb2.GenerateManyResponse(outcomes=outcomes)
        finally:
            # first: a caller that has every answer cancels the call, and this finally
            # may not get past its first await
            tracing.add("GenerateMany", started, time.monotonic(), "GenerateMany", requests=n)
            await cancel_until_done(tasks)  # a caller that went away: its rows are dropped

    async def _acquire(self, request: inference_pb2.GenerateRequest) -> LoadedVersion:
        """The request's adapter version, held (`AdapterRegistry.acquire`). A version its
        run's learner has published but whose push has not landed here yet is waited for,
        up to PUBLISHED_WAIT_S: the learner sends a step's tasks out with its push, not
        after every replica's ack."""
        ref, user = request.adapter, auth.owner_filter()
        try:
            return self.registry.acquire(
                ref.name, ref.version, newest=request.newest_adapter, user=user
            )
        except AdapterNotLoaded as err:
            if not self.joined:
                raise Refused(
                    grpc.StatusCode.UNAVAILABLE,
                    f"{err}; this replica is joining and serves once the learner has "
                    "pushed it every current adapter",
                ) from None
            if not await self._on_its_way(ref, user):
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, str(err)) from None
        await self.registry.wait_for(ref.name, ref.version, PUBLISHED_WAIT_S)
        try:
            return self.registry.acquire(
                ref.name, ref.version, newest=request.newest_adapter, user=user
            )
        except AdapterNotLoaded as err:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, str(err)) from None

    async def _on_its_way(self, ref: common_pb2.AdapterRef, user: str | None) -> bool:
        """Whether `ref` is its run's newest published version and this replica has not
        had it yet (an older version, or one retired here, is not coming)."""
        if self.redis is None or self.registry.get(ref.name, ref.version) is not None:
            return False
        try:
            newest = await replicas.published(
                self.redis, ref.name, self.engine.base_model, user
            )
        except RedisError:
            return False
        return newest == ref.version

    async def _generate(
        self, request: inference_pb2.GenerateRequest, client: str = ""
    ) -> inference_pb2.GenerateResponse:
        """One generation; a request the caller got wrong raises Refused. `client`: the
        peer of the GenerateMany call it came in."""
        if not request.adapter.name:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "adapter.name is required")
        if len(request.request_id) > MAX_REQUEST_ID:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"request_id: at most {MAX_REQUEST_ID} characters")
        sp = request.sampling
        generation = GenerationRequest(
            prompt_token_ids=list(request.prompt_token_ids),
            adapter_key="",
            max_tokens=sp.max_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            seed=sp.seed or None,
            stop_token_ids=list(sp.stop_token_ids),
            client=client,
        )
        try:  # before the request can join a batch: a bad one fails alone
            check_request(generation, self.limits)
        except ValueError as err:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from None
        if not 0 < generation.top_p < 1:
            generation.top_p = 1.0
        # bounded by the context: a longer budget ends there (finish_reason "length")
        generation.max_tokens = min(generation.max_tokens, room(generation, self.limits))
        version = await self._acquire(request)
        generation.adapter_key = version.key
        try:
            result = await self.engine.generate(generation)
        finally:
            await self.registry.release(version)
        return inference_pb2.GenerateResponse(
            token_ids=result.token_ids,
            logprobs=result.logprobs,
            finish_reason=result.finish_reason,
            served_by=common_pb2.AdapterRef(name=version.name, version=version.version),
            request_id=request.request_id,
        )

    async def PushAdapter(
        self,
        request_iterator: AsyncIterator[inference_pb2.AdapterChunk],
        context: grpc.aio.ServicerContext,
    ) -> inference_pb2.PushAdapterResponse:
        await self._require_ready(context)
        started = time.monotonic()
        first = await anext(aiter(request_iterator), None)
        if first is None or not first.HasField("manifest"):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "the first chunk must carry the adapter manifest"
            )
        assert first is not None
        m = first.manifest
        ref = m.ref
        problem = self._check_manifest(m)
        if problem is not None:
            await context.abort(*problem)
        try:
            await check_owner(m, self.fences, self.redis)
            with self.budget.reserve(f"{ref.name}@{ref.version}", m.size_bytes):
                payload = await self._receive(m, request_iterator, context)
                async with self._push_lock:
                    # again: a newer learner of the run may have pushed while this one streamed
                    await check_owner(m, self.fences, self.redis)
                    await self._load(m, payload, context)
        except PushRefused as err:
            await context.abort(err.code, err.message)
        log.info("loaded %s@%d in %.3fs", ref.name, ref.version, time.monotonic() - started)
        return inference_pb2.PushAdapterResponse(
            ref=ref, loaded=True, load_seconds=time.monotonic() - started
        )

    async def _receive(
        self,
        m: common_pb2.AdapterManifest,
        request_iterator: AsyncIterator[inference_pb2.AdapterChunk],
        context: grpc.aio.ServicerContext,
    ) -> bytearray:
        """The push's payload, checked against its manifest's size and sha256."""
        ref = m.ref
        payload = bytearray()
        async for chunk in request_iterator:
            payload.extend(chunk.data)
            if len(payload) > m.size_bytes:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"adapter {ref.name}@{ref.version}: more data than manifest.size_bytes",
                )
        digest = hashlib.sha256(payload).hexdigest()
        if len(payload) != m.size_bytes or digest != m.sha256:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"adapter {ref.name}@{ref.version}: checksum mismatch "
                f"(manifest sha256 {m.sha256[:12]}, received {digest[:12]}, "
                f"{len(payload)}/{m.size_bytes} bytes); push it again",
            )
        return payload

    async def _load(
        self, m: common_pb2.AdapterManifest, payload: bytearray, context: grpc.aio.ServicerContext
    ) -> None:
        """Load a received version (under the push lock); one already held must match."""
        ref = m.ref
        existing = self.registry.get(ref.name, ref.version)
        if existing is not None:
            if existing.sha256 != m.sha256:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"adapter {ref.name}@{ref.version} is already loaded with other weights;"
                    " versions are immutable, push a new version",
                )
        else:
            try:
                state_dict = adapter_io.deserialize(bytes(payload))
            except Exception as err:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"adapter {ref.name}@{ref.version}: payload is not safetensors ({err})",
                )
            int_id = self.registry.next_int_id()
            key = f"{ref.name}@{ref.version}"
            try:
                await self.engine.load_adapter(
                    AdapterWeights(
                        key=key,
                        int_id=int_id,
                        rank=m.rank,
                        alpha=m.alpha,
                        target_modules=list(m.target_modules),
                        state_dict=state_dict,
                    )
                )
            except ValueError as err:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
            await self.registry.added(
                LoadedVersion(ref.name, ref.version, int_id, m.sha256, owner=m.owner),
                keep=m.keep_versions,
            )
            # the payload, the state dict and any version retired just now are freed
            await self.engine.release_free_heap()

    def _check_manifest(self, m: common_pb2.AdapterManifest) -> tuple[grpc.StatusCode, str] | None:
        ref = f"{m.ref.name}@{m.ref.version}"
        if not m.ref.name or m.ref.version < 0:
            return grpc.StatusCode.INVALID_ARGUMENT, "manifest.ref needs a name and a version >= 0"
        if m.base_model != self.engine.base_model:
            return (
                grpc.StatusCode.FAILED_PRECONDITION,
                f"adapter {ref} was trained on base model {m.base_model!r} but this replica "
                f"serves {self.engine.base_model!r}; start inference with the run's model.path",
            )
        if not 1 <= m.rank <= self.engine.max_lora_rank:
            return (
                grpc.StatusCode.INVALID_ARGUMENT,
                f"adapter {ref}: rank {m.rank} is outside 1..{self.engine.max_lora_rank} "
                "(the replica's max LoRA rank)",
            )
        if len(m.owner) > MAX_OWNER:
            return (grpc.StatusCode.INVALID_ARGUMENT,
                    f"adapter {ref}: manifest.owner is over {MAX_OWNER} characters")
        if m.format not in ("", "safetensors"):
            return grpc.StatusCode.INVALID_ARGUMENT, f"adapter {ref}: unknown format {m.format!r}"
        if not 0 < m.size_bytes <= MAX_ADAPTER_BYTES:
            return grpc.StatusCode.INVALID_ARGUMENT, f"adapter {ref}: bad size_bytes {m.size_bytes}"
        if not 0 <= m.keep_versions <= MAX_KEEP_VERSIONS:
            return (
                grpc.StatusCode.INVALID_ARGUMENT,
                f"adapter {ref}: manifest.keep_versions {m.keep_versions} is outside "
                f"0..{MAX_KEEP_VERSIONS} (a run asks for train.max_staleness + 1)",
            )
        return None

    async def ListAdapters(
        self, request: inference_pb2.ListAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ListAdaptersResponse:
        await self._require_ready(context)
        return inference_pb2.ListAdaptersResponse(
            adapters=[
                inference_pb2.LoadedAdapter(
                    ref=common_pb2.AdapterRef(name=v.name, version=v.version),
                    in_flight=v.in_flight,
                    loaded_at=v.loaded_at,
                )
                for v in self.registry.all(auth.owner_filter())
            ]
        )

    async def UnloadAdapter(
        self, request: inference_pb2.UnloadAdapterRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.UnloadAdapterResponse:
        await self._require_ready(context)
        found = await self.registry.retire(request.ref.name, request.ref.version)
        if not found:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"adapter {request.ref.name}@{request.ref.version} is not loaded",
            )
        return inference_pb2.UnloadAdapterResponse(unloaded=True)

    async def GetInfo(
        self, request: inference_pb2.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.GetInfoResponse:
        await self._require_ready(context)
        return inference_pb2.GetInfoResponse(
            base_model=self.engine.base_model,
            engine=self.engine.name,
            replica_id=self.replica_id,
            lora_slots=self.engine.lora_slots or 0,
            max_lora_rank=self.engine.max_lora_rank,
        )


async def await_current_adapters(
    host: ServiceHost,
    service: InferenceService,
    r: aioredis.Redis,
    info: dict[str, Any],
) -> None:
    """Stay joining (announced, NOT_SERVING, taking pushes) until this replica holds the
    current version of every adapter an active run uses.

    The requirement is read again on every check, so a version published while this
    replica catches up is waited for too. Learners publish a version before pushing it
    and this replica announces itself before reading what is current, so either the
    learner's push includes this replica or this replica waits for that version.
    """
    waiting_for: list[str] = []
    # a replica that never catches up must still stop on SIGTERM
    while not host.stopping:
        await replicas.announce(r, "inference", service.replica_id, {**info, "serving": False})
        required = await replicas.current(r, service.engine.base_model)
        missing = sorted(
            adapter_key(name, v)
            for name, v in required.items()
            if not service.registry.holds(name, v)
        )
        if not missing:
            return
        if missing != waiting_for:
            log.info("not serving until these adapters are pushed: %s", ", ".join(missing))
            waiting_for = missing
        await asyncio.sleep(JOIN_CHECK_S)


async def _serve(cfg: InferenceConfig, model_path: str) -> None:
    service_name = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
    server = ServiceHost([service_name], cfg.host, cfg.port)
    replica_id = f"inference-{uuid.uuid4().hex[:8]}"
    redis_client = streams.connect(cfg.redis) if cfg.redis else None
    service = InferenceService(
        replica_id,
        model_limits(model_path),
        redis_client,
        PushBudget(cfg.max_concurrent_pushes, cfg.max_push_bytes),
    )
    inference_pb2_grpc.add_InferenceServicer_to_server(service, server.server)
    ADAPTER_VERSIONS.set_function(
        lambda: 0 if service._registry is None else len(service._registry.all())
    )
    INFERENCE_IN_FLIGHT.set_function(  # the chart scales replicas on it
        lambda: 0 if service._registry is None
        else sum(v.in_flight for v in service._registry.all())
    )
    # model_path: what workers may load a tokenizer from (never a caller's path)
    info: dict[str, Any] = {"address": server.address,
                            "model_path": os.path.realpath(model_path)}
    http = openai = None
    if cfg.http_port is not None:  # OpenAI's /v1 API, served by the same engine and registry
        from services.inference.openai_api import OpenAIApi

        http = HttpServer(cfg.host, cfg.http_port, users=True)
        openai = OpenAIApi(service, model_path)
        openai.add_routes(http)
        await http.start()
        info["http_address"] = http.address

    async def ready() -> None:
        engine = await asyncio.to_thread(make_engine, cfg)
        if openai is not None:
            await openai.load_tokenizer()
        service.attach(engine, AdapterRegistry(engine.unload_adapter, retention=cfg.retention))
        info.update(base_model=engine.base_model, engine=engine.name,
                    lora_slots=engine.lora_slots)
        if redis_client is not None:
            await await_current_adapters(server, service, redis_client, info)
        service.joined = True

    background = []
    if redis_client is not None:

        async def beat() -> None:
            await replicas.heartbeat(
                redis_client, "inference", replica_id, {**info, "serving": True}
            )

        background.append(beat)

    async def on_stop() -> None:
        if http is not None:
            await http.stop()
        if service._engine is not None:
            await service.engine.close()
        if redis_client is not None:
            try:  # workers also drop a replica whose heartbeat stops: never wait on a gone Redis
                await asyncio.wait_for(
                    replicas.withdraw(redis_client, "inference", replica_id), 2.0
                )
            except (TimeoutError, RedisError, OSError) as err:
                log.warning("could not withdraw from the replica registry: %s", err)
            await redis_client.aclose()

    await serve_until_stopped(server, ready=ready, background=background, on_stop=on_stop)


def run(cfg: InferenceConfig) -> None:
    """Serve `cfg.model` until SIGTERM/SIGINT; blocking. The vLLM settings (GPU memory
    share, tensor parallelism, eager mode, LoRA slots...) are ignored by the transformers
    engine, `device` by vLLM. A model name (`demo`, `smollm2`: marl.models.names) serves
    that model's directory, as a run spec's `model.path` does."""
    cfg = cfg.model_copy(update={"model": model_names.resolve(cfg.model_dir())})
    model_path = cfg.model_dir()
    configure_logging("inference")
    keep_freed_heap_until_trimmed()  # a batch's freed blocks are reused, and trimmed after it
    asyncio.run(_serve(cfg, model_path))
