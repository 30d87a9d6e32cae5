"""A replica that joins mid-run gets the run's current adapter versions and, with
train.max_staleness K, the K before them, which tasks queued ahead still name. A real
Redis and real grpc.aio servers on loopback whose PushAdapter records what it got."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from marl.protocol.v1 import inference_pb2_grpc
from marl.runtime import replicas, streams
from marl.spec.run import RunSpec
from services.learner.adapter_sync import AdapterSync
from services.learner.errors import RunCancelled
from tests.support.loopback_grpc import serving
from tests.support.push_replicas import Recording, published


def unused_loopback_address() -> str:
    """A loopback port nothing listens on: a replica killed but still listed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("k", [0, 1, 2])
async def test_a_joining_replica_gets_the_versions_queued_tasks_may_name(
    redis_url: str, k: int
) -> None:
    r = streams.connect(redis_url)
    spec = RunSpec.model_validate({"train": {"max_staleness": k}})
    sync = AdapterSync("run-1", spec, r, {"generator": "shared"}, "base",
                       None)  # type: ignore[arg-type]
    first, late = Recording(), Recording()
    add = inference_pb2_grpc.add_InferenceServicer_to_server
    async with serving(first, add) as a, serving(late, add) as b:
        await replicas.announce(r, "inference", "inference-a",
                                {"address": a, "base_model": "base", "serving": True})
        for version in (1, 2, 3):
            await sync.send({"shared": published(version)})
        assert first.pushed == [1, 2, 3]
        await replicas.announce(r, "inference", "inference-b",
                                {"address": b, "base_model": "base", "serving": False})
        await sync.start()
        deadline = time.monotonic() + 10
        while len(late.pushed) < k + 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.5)  # a sync pass more: nothing else arrives
        assert sync._sync is not None
        sync._sync.cancel()
        await asyncio.gather(sync._sync, return_exceptions=True)
    assert sorted(late.pushed) == list(range(3 - k, 4))
    assert first.pushed == [1, 2, 3]  # it had them all already
    await r.aclose()


async def test_a_push_no_replica_took_waits_for_one_to_come_back(redis_url: str) -> None:
    """The only replica is gone but still listed (killed, its heartbeat not yet expired):
    the push goes on trying what is live, and lands on the replica that registers again."""
    r = streams.connect(redis_url)
    sync = AdapterSync("run-1", RunSpec(), r, {"generator": "shared"}, "base",
                       None)  # type: ignore[arg-type]
    await replicas.announce(r, "inference", "inference-a",
                            {"address": unused_loopback_address(), "base_model": "base",
                             "serving": True})
    push = asyncio.create_task(sync.send({"shared": published(1)}))
    await asyncio.sleep(1.5)
    assert not push.done()
    back = Recording()
    async with serving(back, inference_pb2_grpc.add_InferenceServicer_to_server) as b:
        await replicas.withdraw(r, "inference", "inference-a")
        await replicas.announce(r, "inference", "inference-b",
                                {"address": b, "base_model": "base", "serving": False})
        await asyncio.wait_for(push, timeout=10)
    assert back.pushed == [1]
    assert ("inference-b", "shared", 1) in sync._acked
    await r.aclose()


async def test_a_push_waiting_for_a_replica_ends_when_the_run_is_cancelled(
    redis_url: str,
) -> None:
    """CancelRun while the only replica is gone: the waiting push raises RunCancelled at its
    next check instead of waiting out REPLICA_WAIT_S."""
    r = streams.connect(redis_url)
    cancelled = asyncio.Event()
    checks = 0

    async def check_cancel() -> None:
        nonlocal checks
        checks += 1
        if cancelled.is_set():
            raise RunCancelled()

    sync = AdapterSync("run-1", RunSpec(), r, {"generator": "shared"}, "base",
                       None, check_cancel=check_cancel)  # type: ignore[arg-type]
    await replicas.announce(r, "inference", "inference-a",
                            {"address": unused_loopback_address(), "base_model": "base",
                             "serving": True})
    push = asyncio.create_task(sync.send({"shared": published(1)}))
    await asyncio.sleep(1.5)
    assert not push.done() and checks >= 1
    cancelled.set()
    with pytest.raises(RunCancelled):
        await asyncio.wait_for(push, timeout=10)
    await r.aclose()
