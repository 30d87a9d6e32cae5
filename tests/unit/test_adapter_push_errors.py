"""A push a replica answers with an error: the replica went away (the run goes on with the
others) or it refused the adapter (the run fails, naming it). Against a real grpc.aio server
on loopback whose PushAdapter reads the chunks and aborts with a given code."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from marl.protocol import adapter_io
from marl.protocol.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from marl.spec.run import RunSpec
from services.learner.adapter_sync import AdapterSync, Published
from services.learner.errors import ReplicaUnreachable, RunFailed
from tests.support.loopback_grpc import serving


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


def test_a_replica_with_fewer_lora_slots_than_the_run_needs_is_named_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two adapters at train.max_staleness 1: up to 4 versions in flight. A vLLM replica
    with max_loras 2 is warned of, once; one with 4 and a transformers one (no limit) not."""
    spec = RunSpec.model_validate({"policy": "isolated", "workflow": "voting",
                                   "train": {"max_staleness": 1}})
    sync = AdapterSync("run-1", spec, None, {"generator": "generator", "aggregator": "aggregator"},
                       "base", None)  # type: ignore[arg-type]
    targets = {"inference-a": {"address": "127.0.0.1:1", "lora_slots": 2},
               "inference-b": {"address": "127.0.0.1:2", "lora_slots": 4},
               "inference-c": {"address": "127.0.0.1:3", "lora_slots": None}}
    with caplog.at_level("WARNING", logger="services.learner.adapter_sync"):
        sync.check_lora_slots(targets)
        sync.check_lora_slots(targets)
    assert [r.getMessage() for r in caplog.records] == [
        "run run-1 may have 4 adapter versions in flight (2 adapters x train.max_staleness + 1"
        " = 2), but inference replica inference-a (127.0.0.1:1) batches at most 2 (its "
        "max_loras): requests for the others wait for a batch with room. Start it with "
        "max_loras >= 4."
    ]
