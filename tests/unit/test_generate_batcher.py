"""BatchingStub: concurrent Generate calls go to a replica as one GenerateMany call, and
each caller gets its own answer or error. Against a real grpc.aio server on loopback whose
servicer answers GenerateMany by a fixed rule (the real replica is tested in
tests/integration/test_inference_bad_input.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from marl.protocol.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from services.workflow.generate_batcher import BatchingStub
from tests.support.loopback_grpc import serving


class RuleServicer(inference_pb2_grpc.InferenceServicer):
    """Answers request i with its prompt reversed, after prompt[0] ms; a prompt starting
    with 0 is refused (INVALID_ARGUMENT); `fail_call` aborts the whole call."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.fail_call: grpc.StatusCode | None = None
        self.cancelled = asyncio.Event()

    async def GenerateMany(  # noqa: N802
        self, request: inference_pb2.GenerateManyRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateManyResponse]:
        self.calls.append(len(request.requests))
        if self.fail_call is not None:
            await context.abort(self.fail_call, "replica is shutting down")
        order = sorted(range(len(request.requests)),
                       key=lambda i: request.requests[i].prompt_token_ids[0])
        try:
            for i in order:
                req = request.requests[i]
                await asyncio.sleep(req.prompt_token_ids[0] / 1000)
                if req.prompt_token_ids[0] == 0:
                    outcome = inference_pb2.GenerateOutcome(
                        index=i, code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                        error="prompt_token_ids[0]: 0 is refused here")
                else:
                    outcome = inference_pb2.GenerateOutcome(
                        index=i, response=inference_pb2.GenerateResponse(
                            token_ids=list(reversed(req.prompt_token_ids)),
                            request_id=req.request_id))
                yield inference_pb2.GenerateManyResponse(outcomes=[outcome])
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


@pytest.fixture()
async def rule_replica() -> AsyncIterator[tuple[RuleServicer, str]]:
    """A RuleServicer served on loopback, and its address."""
    servicer = RuleServicer()
    async with serving(servicer, inference_pb2_grpc.add_InferenceServicer_to_server) as address:
        yield servicer, address


@pytest.fixture()
async def served(
    rule_replica: tuple[RuleServicer, str],
) -> AsyncIterator[tuple[RuleServicer, BatchingStub]]:
    servicer, address = rule_replica
    channel = grpc.aio.insecure_channel(address)
    batching = BatchingStub(inference_pb2_grpc.InferenceStub(channel))
    try:
        yield servicer, batching
    finally:
        await batching.close()
        await channel.close()


def request(*ids: int) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        prompt_token_ids=list(ids), adapter=common_pb2.AdapterRef(name="a"),
        request_id="-".join(map(str, ids)))


async def test_concurrent_calls_go_as_one_and_each_caller_gets_its_own_answer(
    served: tuple[RuleServicer, BatchingStub],
) -> None:
    servicer, stub = served
    prompts = [(30, 1, 2), (5, 3), (20, 4, 5, 6), (10, 7)]
    answers = await asyncio.gather(*(stub.Generate(request(*p), timeout=10) for p in prompts))
    assert servicer.calls == [4]
    assert [list(a.token_ids) for a in answers] == [[2, 1, 30], [3, 5], [6, 5, 4, 20], [7, 10]]
    assert [a.request_id for a in answers] == ["30-1-2", "5-3", "20-4-5-6", "10-7"]
    # calls made in a later turn of the event loop go as a call of their own
    await stub.Generate(request(1), timeout=10)
    assert servicer.calls == [4, 1]


async def test_an_answer_does_not_wait_for_the_slower_requests_of_its_call(
    served: tuple[RuleServicer, BatchingStub],
) -> None:
    _, stub = served
    fast = asyncio.ensure_future(stub.Generate(request(1), timeout=10))
    slow = asyncio.ensure_future(stub.Generate(request(400), timeout=10))
    done, _ = await asyncio.wait([fast, slow], return_when=asyncio.FIRST_COMPLETED)
    assert done == {fast} and not slow.done()
    assert list((await slow).token_ids) == [400]


async def test_a_refused_request_raises_its_own_error_and_the_others_are_served(
    served: tuple[RuleServicer, BatchingStub],
) -> None:
    _, stub = served
    good, bad = await asyncio.gather(stub.Generate(request(2, 9), timeout=10),
                                     stub.Generate(request(0, 9), timeout=10),
                                     return_exceptions=True)
    assert isinstance(good, inference_pb2.GenerateResponse)
    assert list(good.token_ids) == [9, 2]
    assert isinstance(bad, grpc.aio.AioRpcError)
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad.details() == "prompt_token_ids[0]: 0 is refused here"


async def test_a_failed_call_fails_every_request_of_it_with_the_call_status(
    served: tuple[RuleServicer, BatchingStub],
) -> None:
    servicer, stub = served
    servicer.fail_call = grpc.StatusCode.UNAVAILABLE
    errors = await asyncio.gather(*(stub.Generate(request(i), timeout=10) for i in (1, 2, 3)),
                                  return_exceptions=True)
    assert servicer.calls == [3]
    assert all(isinstance(e, grpc.aio.AioRpcError) for e in errors)
    assert {e.code() for e in errors if isinstance(e, grpc.aio.AioRpcError)} == {
        grpc.StatusCode.UNAVAILABLE}


async def test_the_call_is_cancelled_once_every_caller_went_away(
    served: tuple[RuleServicer, BatchingStub],
) -> None:
    servicer, stub = served
    callers = [asyncio.ensure_future(stub.Generate(request(t), timeout=10)) for t in (200, 300)]
    await asyncio.sleep(0.05)
    callers[0].cancel()
    await asyncio.sleep(0.3)  # 200's answer arrives for nobody; 300's caller still waits
    assert not servicer.cancelled.is_set() and not callers[1].done()
    callers[1].cancel()
    await asyncio.wait_for(servicer.cancelled.wait(), timeout=5)


async def test_episodes_waiting_on_the_replica_list_send_their_turns_as_one_call(
    rule_replica: tuple[RuleServicer, str], redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker reads the live replicas from Redis at most once a heartbeat; episodes
    that ask while it reads all resume in one turn of the event loop, so their turns go
    to the replica as one GenerateMany, not one call per episode (a real Redis here)."""
    from marl.runtime import replicas, streams
    from services.workflow.worker import EpisodeRunner

    servicer, address = rule_replica
    r = streams.connect(redis_url)
    await replicas.announce(r, "inference", "i0", {"address": address})
    runner = EpisodeRunner(r, "w-test", replica_wait_s=0, judge_endpoints=())
    asked: list[int] = []
    live = replicas.live

    async def counted_live(*args: object, **kwargs: object) -> dict[str, dict[str, object]]:
        asked.append(1)
        return await live(*args, **kwargs)  # type: ignore[arg-type]

    async def turn(i: int) -> list[int]:
        stubs = await runner.stubs()
        return list((await stubs[0].Generate(request(i, 7), timeout=10)).token_ids)

    monkeypatch.setattr(replicas, "live", counted_live)
    try:
        answers = await asyncio.gather(*(turn(i) for i in range(1, 25)))
        assert answers == [[7, i] for i in range(1, 25)]
        assert asked == [1]
        assert servicer.calls == [24]
    finally:
        await runner.close()
        await r.aclose()
