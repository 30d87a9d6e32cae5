"""One inference replica's Generate, with the calls a worker makes at once sent as one.

A worker's episodes ask for their turns together: a step's tasks arrive in one read,
Voting's generators start at once. Each unary Generate costs client and server CPU of its
own (grpc.aio), several times what the same replies cost on one stream, so on a small
model a step's calls cost as much as the engine's whole batch of them. `BatchingStub.Generate` keeps the
stub's signature, queues the request, and sends everything queued in one turn of the
event loop as one GenerateMany call; each caller gets its own response, or the error
Generate would have raised for it, as soon as the replica has it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc

from marl.protocol.v1 import inference_pb2, inference_pb2_grpc

log = logging.getLogger(__name__)

CODES = {code.value[0]: code for code in grpc.StatusCode}


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a unary Generate would have raised with this status."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@dataclass
class _Call:
    requests: list[inference_pb2.GenerateRequest] = field(default_factory=list)
    futures: list[asyncio.Future[inference_pb2.GenerateResponse]] = field(default_factory=list)
    timeout: float | None = None


class BatchingStub:
    """`Generate(request, timeout)` as on an InferenceStub, batched per event-loop turn."""

    def __init__(self, stub: inference_pb2_grpc.InferenceStub):
        self.stub = stub
        self._queued: _Call | None = None
        self._calls: set[asyncio.Task[None]] = set()

    async def Generate(  # noqa: N802 (the stub's method name)
        self, request: inference_pb2.GenerateRequest, timeout: float | None = None
    ) -> inference_pb2.GenerateResponse:
        loop = asyncio.get_running_loop()
        if self._queued is None:
            self._queued = _Call()
            loop.call_soon(self._send)
        call = self._queued
        future: asyncio.Future[inference_pb2.GenerateResponse] = loop.create_future()
        call.requests.append(request)
        call.futures.append(future)
        if timeout is not None:
            call.timeout = timeout if call.timeout is None else max(call.timeout, timeout)
        return await future

    def _send(self) -> None:
        call, self._queued = self._queued, None
        if call is None:
            return
        task = asyncio.get_running_loop().create_task(self._run(call))
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _run(self, call: _Call) -> None:  # noqa: C901 (older than the limit; split it when next changed)
        futures = call.futures
        stream = self.stub.GenerateMany(
            inference_pb2.GenerateManyRequest(requests=call.requests), timeout=call.timeout
        )

        unsettled = len(futures)

        def settled(_: asyncio.Future[inference_pb2.GenerateResponse]) -> None:
            nonlocal unsettled
            unsettled -= 1
            if not unsettled:  # every request answered, or its caller went away:
                stream.cancel()  # the replica drops the rows nobody waits for

        for future in futures:
            future.add_done_callback(settled)
        try:
            async for message in stream:
                for outcome in message.outcomes:
                    if not 0 <= outcome.index < len(futures):
                        log.warning("GenerateMany answered index %d of a call of %d",
                                    outcome.index, len(futures))
                        continue
                    future = futures[outcome.index]
                    if future.done():
                        continue
                    if outcome.code:
                        code = CODES.get(outcome.code, grpc.StatusCode.UNKNOWN)
                        future.set_exception(rpc_error(code, outcome.error))
                    else:
                        future.set_result(outcome.response)
        except grpc.aio.AioRpcError as err:  # the call failed: so does every request left
            for future in futures:
                if not future.done():
                    future.set_exception(err)
        except asyncio.CancelledError:
            if all(f.done() for f in futures):
                return  # `settled` cancelled the call
            stream.cancel()
            for future in futures:
                future.cancel()
            raise
        for future in futures:
            if not future.done():
                future.set_exception(rpc_error(
                    grpc.StatusCode.INTERNAL, "GenerateMany ended without this request's outcome"
                ))

    async def close(self) -> None:
        """Cancel the calls under way (their callers get CancelledError)."""
        for task in list(self._calls):
            task.cancel()
        await asyncio.gather(*self._calls, return_exceptions=True)
