"""A push a replica answers with an error: the replica went away (the run goes on with the
others) or it refused the adapter (the run fails, naming it). Against a real grpc.aio server
on loopback whose PushAdapter reads the chunks and aborts with a given code."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from loopback_grpc import serving

from marl import adapter_io
from marl.config import RunSpec
from marl.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.learner.adapter_sync import AdapterSync, Published
from services.learner.errors import ReplicaUnreachable, RunFailed


class Aborting(inference_pb2_grpc.InferenceServicer):
    def __init__(self, code: grpc.StatusCode):
        self.code = code
        self.chunks = 0

    async def PushAdapter(  # noqa: N802
        self, request_iterator: AsyncIterator[common_pb2.AdapterChunk],
        context: grpc.aio.ServicerContext,
    ) -> inference_pb2.PushAdapterResponse:
        async for _ in request_iterator:
            self.chunks += 1
        await context.abort(self.code, "told to")
        raise AssertionError("context.abort returned")


@pytest.mark.parametrize(("code", "error"), [
    (grpc.StatusCode.UNAVAILABLE, ReplicaUnreachable),
    (grpc.StatusCode.CANCELLED, ReplicaUnreachable),  # a stopping replica (grpc/grpc#41785)
    (grpc.StatusCode.INVALID_ARGUMENT, RunFailed),
    (grpc.StatusCode.FAILED_PRECONDITION, RunFailed),
])
async def test_a_push_error_is_a_lost_replica_or_a_refusal(
    code: grpc.StatusCode, error: type[Exception]
) -> None:
    servicer = Aborting(code)
    sync = AdapterSync("run-1", RunSpec(), None, {"solver": "shared"}, "base",
                       None)  # type: ignore[arg-type]
    payload = b"\0" * 64
    manifest = adapter_io.make_manifest("run-1/shared", 3, "base", 16, 32.0, ["q_proj"], payload)
    async with serving(servicer, inference_pb2_grpc.add_InferenceServicer_to_server) as address:
        with pytest.raises(error) as raised:
            await sync._push_one("inference-a", address, "shared", Published(3, manifest, payload))
    assert address in str(raised.value)
    assert "run-1/shared@3" in str(raised.value)
    assert servicer.chunks >= 1
