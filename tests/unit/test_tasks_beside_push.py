"""A step's tasks go out with its push, not after its acks (`AdapterSync.send`'s `beside`):
the learner publishes the new versions, and a replica holds a request for a published
version until its push lands (`InferenceService._acquire`). A real Redis throughout; the
learner's side pushes to real grpc.aio servers on loopback, the replica's side is the
service in process on an engine that echoes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from marl.models.limits import ModelLimits
from marl.protocol.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from marl.runtime import auth, replicas, streams
from marl.spec.run import RunSpec
from marl.spec.users import Identity
from services.inference import server
from services.inference.adapters import AdapterRegistry, LoadedVersion
from services.inference.engine import GenerationRequest, GenerationResult
from services.learner.adapter_sync import AdapterSync
from tests.support.loopback_grpc import serving
from tests.support.push_replicas import Recording, published


class GatedReplica(Recording):
    """Takes a push only once `gate` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def PushAdapter(  # noqa: N802
        self, request_iterator: AsyncIterator[common_pb2.AdapterChunk],
        context: grpc.aio.ServicerContext,
    ) -> inference_pb2.PushAdapterResponse:
        await self.gate.wait()
        return await super().PushAdapter(request_iterator, context)


@pytest.mark.parametrize("serves", [True, False])
async def test_the_tasks_go_out_beside_a_push_only_to_serving_replicas(
    redis_url: str, serves: bool
) -> None:
    """Every replica serves: the tasks go out while the push is under way. One is joining
    (it takes requests only once it holds every current version): after its ack."""
    r = streams.connect(redis_url)
    sync = AdapterSync("run-1", RunSpec(), r, {"generator": "shared"}, "base",
                       None)  # type: ignore[arg-type]
    replica = GatedReplica()
    released: list[list[int]] = []

    async def beside() -> None:
        released.append(list(replica.pushed))

    async with serving(replica, inference_pb2_grpc.add_InferenceServicer_to_server) as a:
        await replicas.announce(r, "inference", "inference-a",
                                {"address": a, "base_model": "base", "serving": serves})
        send = asyncio.create_task(sync.send({"shared": published(1)}, beside))
        for _ in range(100):
            if released or send.done():
                break
            await asyncio.sleep(0.02)
        assert released == ([[]] if serves else [])
        assert await replicas.published(r, "run-1/shared", "base", None) == 1
        replica.gate.set()
        await asyncio.wait_for(send, timeout=10)
    assert released == [[]] if serves else [[1]]
    assert replica.pushed == [1]
    await r.aclose()


class EchoEngine:
    base_model = "base"

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        return GenerationResult([request.prompt_token_ids[0]], [-0.5], "stop")


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code = code


class Context:
    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


async def replica(redis_url: str) -> tuple[server.InferenceService, AdapterRegistry, Any]:
    """A serving replica that holds run-1/shared@1 and run-2/shared@1 (user bob's)."""
    r = streams.connect(redis_url)
    service = server.InferenceService("r-test", ModelLimits(context=64, vocab_size=100), r)
    service.joined = True

    async def unload(key: str) -> None:
        pass

    registry = AdapterRegistry(unload, retention=1)
    await registry.added(LoadedVersion("run-1/shared", 1, 1, "0" * 64, owner="alice"))
    await registry.added(LoadedVersion("run-2/shared", 1, 2, "0" * 64, owner="bob"))
    service.attach(EchoEngine(), registry)  # type: ignore[arg-type]
    return service, registry, r


def generate(service: server.InferenceService, name: str, version: int
             ) -> asyncio.Task[inference_pb2.GenerateResponse]:
    request = inference_pb2.GenerateRequest(
        prompt_token_ids=[7], adapter=common_pb2.AdapterRef(name=name, version=version),
        sampling=inference_pb2.SamplingParams(max_tokens=1))
    return asyncio.create_task(service.Generate(request, Context()))  # type: ignore[arg-type]


async def refused_at_once(call: asyncio.Task[inference_pb2.GenerateResponse]) -> grpc.StatusCode:
    with pytest.raises(Aborted) as err:
        await asyncio.wait_for(call, timeout=5)  # PUBLISHED_WAIT_S is 30 s
    return err.value.code


async def test_a_request_for_a_published_version_is_served_once_its_push_lands(
    redis_url: str,
) -> None:
    service, registry, r = await replica(redis_url)
    await replicas.publish_current(r, "base", "run-1", {"run-1/shared": 2}, owner="alice")
    call = generate(service, "run-1/shared", 2)
    await asyncio.sleep(0.3)
    assert not call.done()
    await registry.added(LoadedVersion("run-1/shared", 2, 3, "0" * 64, owner="alice"))
    reply = await asyncio.wait_for(call, timeout=5)
    assert (reply.served_by.name, reply.served_by.version) == ("run-1/shared", 2)
    await r.aclose()


async def test_a_version_no_push_is_bringing_fails_at_once(redis_url: str) -> None:
    """Not published; older than the published one; published for other replicas' base
    model; or published by another user's run, for a request made for this one."""
    service, _, r = await replica(redis_url)
    assert await refused_at_once(generate(service, "run-1/shared", 2)) == (
        grpc.StatusCode.FAILED_PRECONDITION)
    await replicas.publish_current(r, "base", "run-1", {"run-1/shared": 3}, owner="alice")
    assert await refused_at_once(generate(service, "run-1/shared", 2)) == (
        grpc.StatusCode.FAILED_PRECONDITION)
    await replicas.publish_current(r, "other", "run-1", {"run-1/shared": 4}, owner="alice")
    assert await refused_at_once(generate(service, "run-1/shared", 4)) == (
        grpc.StatusCode.FAILED_PRECONDITION)
    await replicas.publish_current(r, "base", "run-2", {"run-2/shared": 2}, owner="bob")
    token = auth._CALLER.set(Identity("alice"))  # a call alice made
    try:
        assert await refused_at_once(generate(service, "run-2/shared", 2)) == (
            grpc.StatusCode.FAILED_PRECONDITION)
    finally:
        auth._CALLER.reset(token)
    await r.aclose()


async def test_a_published_version_that_never_lands_fails_after_the_wait(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server, "PUBLISHED_WAIT_S", 0.3)
    service, _, r = await replica(redis_url)
    await replicas.publish_current(r, "base", "run-1", {"run-1/shared": 2}, owner="alice")
    call = generate(service, "run-1/shared", 2)
    await asyncio.sleep(0.1)
    assert not call.done()
    assert await refused_at_once(call) == grpc.StatusCode.FAILED_PRECONDITION
    await r.aclose()
