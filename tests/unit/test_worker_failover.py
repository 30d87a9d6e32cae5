"""A worker's replica list is read from Redis at most once a heartbeat, so it can miss a
replica that turned serving since. When every listed replica turns a turn away (here the
only one listed has stopped: connection refused), the turn reads the registry again and
goes to the replica that joined, instead of failing its episode. A real Redis, a real
grpc.aio replica stand-in on loopback, and the worker's own BatchingStub channels."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from marl.protocol.v1 import inference_pb2, inference_pb2_grpc
from marl.runtime import replicas, streams
from services.workflow import worker
from services.workflow.worker import EpisodeRunner
from tests.support.loopback_grpc import serving
from tests.support.worker_loop import working
from tests.support.workflows_scripted import CharTokenizer, make_task


class Answers(inference_pb2_grpc.InferenceServicer):
    """Answers every request with `\\boxed{5}` (CharTokenizer ids), served by itself."""

    def __init__(self) -> None:
        self.requests = 0

    async def GenerateMany(  # noqa: N802
        self, request: inference_pb2.GenerateManyRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateManyResponse]:
        for i, req in enumerate(request.requests):
            self.requests += 1
            yield inference_pb2.GenerateManyResponse(outcomes=[inference_pb2.GenerateOutcome(
                index=i, response=inference_pb2.GenerateResponse(
                    token_ids=[ord(c) for c in "\\boxed{5}"], logprobs=[0.0] * 9,
                    finish_reason="stop", served_by=req.adapter, request_id=req.request_id))])


def refused_address() -> str:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


async def test_a_turn_every_listed_replica_refused_goes_to_one_that_joined_since(
    redis_url: str,
) -> None:
    r = streams.connect(redis_url)
    answers = Answers()
    runner = EpisodeRunner(r, "w-test", replica_wait_s=0, judge_endpoints=())
    runner._tokenizers[""] = CharTokenizer()
    try:
        async with serving(answers, inference_pb2_grpc.add_InferenceServicer_to_server) as up:
            gone = refused_address()
            await replicas.announce(r, "inference", "gone", {"address": gone})
            await replicas.announce(r, "inference", "joins", {"address": up, "serving": False})
            await runner.stubs()
            assert runner._replicas == [gone]
            await replicas.announce(r, "inference", "joins", {"address": up, "serving": True})
            assert runner.replicas_age() < replicas.HEARTBEAT_S  # the list is not re-read

            rollouts = await asyncio.gather(*(runner.run(make_task("single", seed=s))
                                              for s in range(4)))
            assert [ro.error for ro in rollouts] == [None] * 4
            assert [ro.reward for ro in rollouts] == [1.0] * 4
            assert answers.requests == 4
            assert sorted(runner._replicas) == sorted([gone, up])

            await replicas.withdraw(r, "inference", "joins")  # no replica can serve now
            await runner.refresh_replicas()
            failed = await runner.run(make_task("single"))
            assert failed.error is not None and failed.error.startswith("NoReplica: ")
            assert "UNAVAILABLE" in failed.error and answers.requests == 4
    finally:
        await runner.close()
        await r.aclose()


class Refuses(inference_pb2_grpc.InferenceServicer):
    """A replica that turns every request away with `code`: UNAVAILABLE as one going
    away, FAILED_PRECONDITION as a serving one that does not hold the adapter version."""

    def __init__(self, code: grpc.StatusCode) -> None:
        self.code = code
        self.requests = 0

    async def GenerateMany(  # noqa: N802
        self, request: inference_pb2.GenerateManyRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateManyResponse]:
        self.requests += len(request.requests)
        await context.abort(self.code, "told to")
        yield inference_pb2.GenerateManyResponse()


async def test_a_turn_waits_for_the_only_replica_to_come_back(redis_url: str) -> None:
    """The only replica is gone (its entry still listed, then none at all): turns wait,
    re-reading the registry, and are served once a replica registers again."""
    r = streams.connect(redis_url)
    answers = Answers()
    runner = EpisodeRunner(r, "w-test", replica_wait_s=30.0, judge_endpoints=())
    runner._tokenizers[""] = CharTokenizer()
    try:
        gone = refused_address()
        await replicas.announce(r, "inference", "gone", {"address": gone})
        episodes = [asyncio.create_task(runner.run(make_task("single", seed=s)))
                    for s in range(3)]
        await asyncio.sleep(1.2)
        await replicas.withdraw(r, "inference", "gone")
        late = asyncio.create_task(runner.run(make_task("single", seed=3)))  # none registered
        await asyncio.sleep(1.2)
        assert not any(e.done() for e in [*episodes, late])
        async with serving(answers, inference_pb2_grpc.add_InferenceServicer_to_server) as up:
            await replicas.announce(r, "inference", "back", {"address": up})
            rollouts = await asyncio.wait_for(asyncio.gather(*episodes, late), timeout=10)
        assert [ro.error for ro in rollouts] == [None] * 4
        assert [ro.reward for ro in rollouts] == [1.0] * 4 and answers.requests == 4
    finally:
        await runner.close()
        await r.aclose()


async def test_the_wait_ends_at_its_limit_or_at_a_replica_that_lacks_the_version(
    redis_url: str,
) -> None:
    """Request counts, not clocks: a 1 s wait polling every 0.5 s sends the listed
    replica's request, one on a fresh read at once and one or two after a pause; a
    replica that lacks the version ends a 30 s wait after the fresh read."""
    r = streams.connect(redis_url)
    runner = EpisodeRunner(r, "w-test", replica_wait_s=1.0, judge_endpoints=())
    runner._tokenizers[""] = CharTokenizer()
    going, lacks = (Refuses(grpc.StatusCode.UNAVAILABLE),
                    Refuses(grpc.StatusCode.FAILED_PRECONDITION))
    add = inference_pb2_grpc.add_InferenceServicer_to_server
    try:
        async with serving(going, add) as a, serving(lacks, add) as b:
            await replicas.announce(r, "inference", "going", {"address": a})
            failed = await runner.run(make_task("single"))
            assert failed.error is not None and "UNAVAILABLE" in failed.error
            assert 3 <= going.requests <= 4

            await replicas.withdraw(r, "inference", "going")
            await replicas.announce(r, "inference", "lacks", {"address": b})
            await runner.refresh_replicas()
            runner.replica_wait_s = 30.0
            failed = await runner.run(make_task("single"))
        assert failed.error is not None and "FAILED_PRECONDITION" in failed.error
        assert lacks.requests == 2  # the listed replica, then the same on a fresh read
    finally:
        await runner.close()
        await r.aclose()


async def queue(r: Any, *tasks: Any) -> list[str]:
    await streams.ensure_group(r, streams.TASKS, streams.WORKERS_GROUP)
    return [await streams.add(r, streams.TASKS, t.to_dict()) for t in tasks]


async def held(r: Any) -> set[str]:
    """The task entries a worker holds, read and not acknowledged."""
    rows = await r.xpending_range(streams.TASKS, streams.WORKERS_GROUP, "-", "+", 10)
    return {row["message_id"] for row in rows}


async def until_held(r: Any, entries: set[str], within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while await held(r) != entries:
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


async def test_a_task_its_run_took_back_ends_its_wait_for_a_replica(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No replica is up and the worker's turns wait (60 s). The learner of a run that
    ended deletes its tasks from the stream (`Episodes.withdraw`): that task's episode
    stops waiting within seconds, its entry acknowledged and no rollout sent, while the
    task still queued goes on waiting."""
    monkeypatch.setattr(worker, "import_tokenizers", lambda: None)
    r = streams.connect(redis_url)
    runner = EpisodeRunner(r, "w-test", replica_wait_s=60.0, judge_endpoints=())
    runner._tokenizers[""] = CharTokenizer()
    taken_back, kept = await queue(r, make_task("single", seed=0), make_task("single", seed=1))
    try:
        async with working(runner) as loop:
            await until_held(r, {taken_back, kept}, 10, "the worker did not take both tasks")
            await asyncio.sleep(1.5)  # both turns are waiting for a replica now
            await r.xdel(streams.TASKS, taken_back)
            await until_held(r, {kept}, 5, "the taken-back task still waits")
            assert not loop.done() and runner.stats.in_flight == 1
            assert runner.stats.withdrawn == 1
            assert await r.xlen(streams.rollouts_stream("run-1")) == 0
    finally:
        await r.aclose()


class SlowAnswers(Answers):
    """Answers as `Answers` does, each call after `delay_s`; counts the calls whose client
    went away meanwhile."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.arrived = 0
        self.dropped = 0

    async def GenerateMany(  # noqa: N802
        self, request: inference_pb2.GenerateManyRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateManyResponse]:
        self.arrived += len(request.requests)
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.dropped += 1
            raise
        async for out in super().GenerateMany(request, context):
            yield out


async def test_an_episode_whose_task_was_taken_back_stops_with_its_turns_in_flight(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replica takes 30 s a call. A Voting and a Single episode wait on their first
    turns (four rows of one call) when their tasks are deleted: both stop within
    seconds, the replica sees its call cancelled (so it drops the rows), the entries are
    acknowledged, and no rollout reaches the run's stream."""
    monkeypatch.setattr(worker, "import_tokenizers", lambda: None)
    r = streams.connect(redis_url)
    slow = SlowAnswers(30.0)
    runner = EpisodeRunner(r, "w-test", replica_wait_s=0, judge_endpoints=())
    runner._tokenizers[""] = CharTokenizer()
    try:
        async with serving(slow, inference_pb2_grpc.add_InferenceServicer_to_server) as up:
            await replicas.announce(r, "inference", "slow", {"address": up})
            voting, single = await queue(r, make_task("voting"), make_task("single", seed=1))
            async with working(runner):
                await until_held(r, {voting, single}, 10, "the worker did not take both tasks")
                await asyncio.sleep(0.5)
                assert slow.arrived == 4  # three generators, the single turn
                await r.xdel(streams.TASKS, voting, single)
                await until_held(r, set(), 5, "the worker still holds a taken-back task")
                deadline = time.monotonic() + 5
                while not slow.dropped:
                    assert time.monotonic() < deadline, "the replica's call was not cancelled"
                    await asyncio.sleep(0.05)
                assert slow.arrived == 4 and slow.requests == 0
                assert runner.stats.withdrawn == 2
                assert runner.stats.in_flight == 0
                assert await r.xlen(streams.rollouts_stream("run-1")) == 0
    finally:
        await r.aclose()
