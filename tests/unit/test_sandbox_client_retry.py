"""The sandbox client sends a call again when the server was stopping (UNAVAILABLE, or
CANCELLED for a call no handler took yet: grpc/grpc#41785), and raises any other error at
once. Against a real grpc.aio server on loopback that refuses the first calls it gets."""

from __future__ import annotations

import grpc
import pytest

from marl.clients.sandbox import AsyncSandboxClient
from marl.protocol.v1 import sandbox_pb2, sandbox_pb2_grpc
from tests.support.loopback_grpc import serving


class RefusesFirst(sandbox_pb2_grpc.SandboxServicer):
    def __init__(self, code: grpc.StatusCode, refusals: int):
        self.code = code
        self.refusals = refusals
        self.calls = 0

    async def Execute(  # noqa: N802
        self, request: sandbox_pb2.ExecuteRequest, context: grpc.aio.ServicerContext
    ) -> sandbox_pb2.ExecuteResponse:
        self.calls += 1
        if self.calls <= self.refusals:
            await context.abort(self.code, "stopping")
        return sandbox_pb2.ExecuteResponse(
            results=[sandbox_pb2.TestResult(verdict=sandbox_pb2.Verdict.PASSED)],
            pass_rate=1.0, isolation_tier="test")


@pytest.mark.parametrize(("code", "calls"), [
    (grpc.StatusCode.UNAVAILABLE, 3),
    (grpc.StatusCode.CANCELLED, 3),
    (grpc.StatusCode.INTERNAL, 1),
])
async def test_a_stopping_server_is_asked_again(code: grpc.StatusCode, calls: int) -> None:
    servicer = RefusesFirst(code, refusals=2)
    tests = [{"stdin": "", "expected_stdout": "1\n"}]
    async with (serving(servicer, sandbox_pb2_grpc.add_SandboxServicer_to_server) as address,
                AsyncSandboxClient(address) as client):
        if calls == 1:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await client.execute("print(1)", tests)
            assert raised.value.code() == code
        else:
            assert (await client.execute("print(1)", tests)).verdicts == ["PASSED"]
    assert servicer.calls == calls
