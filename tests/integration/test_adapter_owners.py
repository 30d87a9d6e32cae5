"""An adapter name belongs to its run, pushes carry their learner's fencing token, and a
replica buffers a bounded number of pushes and bytes at once.

One real `marl serve inference` process (transformers engine, the shipped demo model) on
a real Redis, started with `max_concurrent_pushes` 1 and `max_push_bytes` 1 MiB (from
`MARL_INFERENCE_*`, as the chart's Secret would set them). Runs' fencing tokens are set in
Redis as a learner's lease take sets them (services/learner/runs.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest
import redis
import torch

from marl.local.launcher import Cluster
from marl.models.demo import demo_model_dir
from marl.protocol import adapter_io
from marl.protocol.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from marl.runtime import fences

TARGETS = ["q_proj", "v_proj"]
MiB = 1 << 20


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model_dir = demo_model_dir()
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                          LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    state = {k: torch.zeros_like(v) for k, v in get_peft_model_state_dict(peft).items()}
    payload = adapter_io.serialize(state)
    assert len(payload) < MiB // 2, "the test's pushes must fit twice in max_push_bytes"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MARL_INFERENCE_MAX_CONCURRENT_PUSHES", "1")
        env.setenv("MARL_INFERENCE_MAX_PUSH_BYTES", str(MiB))
        cluster = Cluster(tmp_path_factory.mktemp("owners"), str(model_dir),
                          workflow_replicas=0, sandbox_replicas=0, learner=False,
                          max_lora_rank=8)
        endpoints = cluster.start()
    try:
        (address,) = endpoints["inference"]
        stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(address))
        base = stub.GetInfo(inference_pb2.GetInfoRequest(), timeout=10).base_model
        with redis.Redis.from_url(endpoints["redis"], decode_responses=True) as r:
            yield {"stub": stub, "address": address, "base": base, "payload": payload,
                   "redis": r}
    finally:
        cluster.stop()


def manifest(replica: dict[str, Any], name: str, version: int, run_id: str = "",
             fence: int = 0, payload: bytes | None = None) -> common_pb2.AdapterManifest:
    return adapter_io.make_manifest(
        name, version, replica["base"], 4, 8.0, TARGETS,
        replica["payload"] if payload is None else payload, run_id=run_id, fence=fence)


def push(replica: dict[str, Any], m: common_pb2.AdapterManifest,
         payload: bytes | None = None) -> grpc.StatusCode:
    try:
        replica["stub"].PushAdapter(
            adapter_io.chunks(m, replica["payload"] if payload is None else payload),
            timeout=60)
    except grpc.RpcError as err:
        return err.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def details(replica: dict[str, Any], m: common_pb2.AdapterManifest) -> str:
    with pytest.raises(grpc.RpcError) as err:
        replica["stub"].PushAdapter(adapter_io.chunks(m, replica["payload"]), timeout=60)
    return err.value.details() or ""


def loaded(replica: dict[str, Any], name: str) -> list[int]:
    listed = replica["stub"].ListAdapters(inference_pb2.ListAdaptersRequest(), timeout=10)
    return sorted(a.ref.version for a in listed.adapters if a.ref.name == name)


def lease_taken(replica: dict[str, Any], run_id: str) -> int:
    """A learner took the run's lease: the run's fencing token counts up."""
    return int(replica["redis"].hincrby(fences.run_record_key(run_id), fences.FIELD, 1))


def test_a_push_under_another_runs_adapter_name_is_refused(replica: dict[str, Any]) -> None:
    fence = lease_taken(replica, "owner-1")
    for version in (1, 2):
        assert push(replica, manifest(replica, "owner-1/p", version, "owner-1", fence)) \
            == grpc.StatusCode.OK
    other = lease_taken(replica, "other-1")
    # run other-1's learner names owner-1's adapter: refused, whatever its versions
    m = manifest(replica, "owner-1/p", 100, "other-1", other)
    assert push(replica, m) == grpc.StatusCode.PERMISSION_DENIED
    assert "belongs to run owner-1" in details(replica, m)
    # naming no run, it may not push a learner's run's adapter, whatever token it guesses
    for fence_given in (0, fence):
        assert push(replica, manifest(replica, "owner-1/p", 101, "", fence_given)) \
            == grpc.StatusCode.PERMISSION_DENIED
    assert push(replica, manifest(replica, "nobody", 1)) == grpc.StatusCode.INVALID_ARGUMENT
    # its own pushes, many versions on, cannot retire owner-1's
    for version in (1, 2, 3, 4):
        assert push(replica, manifest(replica, "other-1/p", version, "other-1", other)) \
            == grpc.StatusCode.OK
    assert loaded(replica, "owner-1/p") == [1, 2]


def test_the_stale_learners_pushes_are_refused_by_the_new_holders_token(
    replica: dict[str, Any],
) -> None:
    old = lease_taken(replica, "fenced-1")
    assert push(replica, manifest(replica, "fenced-1/p", 1, "fenced-1", old)) \
        == grpc.StatusCode.OK
    new = lease_taken(replica, "fenced-1")  # another learner took the run over
    m = manifest(replica, "fenced-1/p", 2, "fenced-1", old)
    assert push(replica, m) == grpc.StatusCode.ABORTED
    assert f"fencing token {old} is stale" in details(replica, m)
    assert push(replica, manifest(replica, "fenced-1/p", 50, "fenced-1", new + 1)) \
        == grpc.StatusCode.ABORTED  # a token no lease was given
    assert push(replica, manifest(replica, "fenced-1/p", 50, "fenced-1", new)) \
        == grpc.StatusCode.OK
    assert loaded(replica, "fenced-1/p") == [1, 50]


async def _held_push(address: str, m: common_pb2.AdapterManifest, payload: bytes,
                     release: asyncio.Event) -> grpc.StatusCode:
    """A push that sends its manifest and half its payload, then waits for `release`."""
    async def chunks() -> AsyncIterator[inference_pb2.AdapterChunk]:
        yield inference_pb2.AdapterChunk(manifest=m)
        yield inference_pb2.AdapterChunk(data=payload[: len(payload) // 2])
        await release.wait()
        yield inference_pb2.AdapterChunk(data=payload[len(payload) // 2:])

    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        try:
            await stub.PushAdapter(chunks(), timeout=120)
        except grpc.aio.AioRpcError as err:
            return err.code()
    return grpc.StatusCode.OK


def test_pushes_past_the_caps_are_resource_exhausted(replica: dict[str, Any]) -> None:
    fence = lease_taken(replica, "busy-1")
    big = bytes(MiB + 1)
    m_big = adapter_io.make_manifest("busy-1/p", 1, replica["base"], 4, 8.0, TARGETS, big,
                                     run_id="busy-1", fence=fence)
    assert push(replica, m_big, big) == grpc.StatusCode.FAILED_PRECONDITION  # never fits

    async def main() -> tuple[grpc.StatusCode, list[grpc.StatusCode]]:
        release = asyncio.Event()

        def hold() -> asyncio.Task[grpc.StatusCode]:
            m = manifest(replica, "busy-1/p", 2, "busy-1", fence)
            return asyncio.create_task(_held_push(replica["address"], m, replica["payload"],
                                                  release))

        held = hold()
        codes = []
        version = 3
        deadline = time.monotonic() + 60
        # until the held push has taken the one slot, another may still get in (or take
        # the slot first, and the held one is refused: it is tried again)
        while grpc.StatusCode.RESOURCE_EXHAUSTED not in codes:
            assert time.monotonic() < deadline, f"no push was refused: {codes[-3:]}, {held}"
            if held.done():
                codes.append(held.result())
                held = hold()
            m = manifest(replica, "busy-1/p", version, "busy-1", fence)
            codes.append(await asyncio.to_thread(push, replica, m))
            version += 1
            await asyncio.sleep(0.1)
        release.set()
        return await held, codes

    held, codes = asyncio.run(main())
    assert {held, *codes} <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
    # the slot is free again
    assert push(replica, manifest(replica, "busy-1/p", 90, "busy-1", fence)) \
        == grpc.StatusCode.OK
