"""Inference replicas that only take pushes, for tests of the learner's push
(`AdapterSync`): one that records what it got, and the versions it is sent."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from marl.protocol import adapter_io
from marl.protocol.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.learner.adapter_sync import Published


class Recording(inference_pb2_grpc.InferenceServicer):
    def __init__(self) -> None:
        self.pushed: list[int] = []
        """The version of each push, in the order they came."""

    async def PushAdapter(  # noqa: N802
        self, request_iterator: AsyncIterator[common_pb2.AdapterChunk],
        context: grpc.aio.ServicerContext,
    ) -> inference_pb2.PushAdapterResponse:
        manifest = None
        async for chunk in request_iterator:
            if chunk.HasField("manifest"):
                manifest = chunk.manifest
        assert manifest is not None
        self.pushed.append(int(manifest.ref.version))
        return inference_pb2.PushAdapterResponse(ref=manifest.ref, loaded=True)


def published(version: int) -> Published:
    """Version `version` of run-1/shared on base model "base", 64 bytes of payload."""
    payload = bytes([version]) * 64
    manifest = adapter_io.make_manifest(
        "run-1/shared", version, "base", 4, 8.0, ["q_proj"], payload)
    return Published(version, manifest, payload)
