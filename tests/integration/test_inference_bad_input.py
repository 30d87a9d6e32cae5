"""Bad generation requests fail alone, clearly, and never wedge the replica.

One real `marl serve inference` process (transformers engine, the shipped demo
model) with one pushed adapter. The classes a hostile client found:
1. one bad request batched with good ones (a token id outside the vocabulary)
   failed them all: now it is refused before it joins a batch, and even a
   request that fails inside the engine fails alone (`test_engine_*`);
2. non-finite sampling parameters and a huge `max_tokens` wedged the server:
   now they are INVALID_ARGUMENT naming the field, and the next call is served;
3. an error echoing a huge input exceeded gRPC's metadata limit ("Stream
   removed"): error messages are now cut.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
import torch

from marl.local.launcher import Cluster
from marl.models.demo import demo_model_dir
from marl.models.limits import ModelLimits, model_limits
from marl.protocol import adapter_io
from marl.protocol.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from marl.runtime.serving import MAX_DETAILS_BYTES
from services.inference.engine import GenerationRequest, check_request

TARGETS = ["q_proj", "v_proj"]
ADAPTER = common_pb2.AdapterRef(name="bad-input/p", version=0)


@pytest.fixture(scope="module")
def replica(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[inference_pb2_grpc.InferenceStub, str, bytes]]:
    """The replica's stub, its base model and the payload of the adapter pushed to it."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model_dir = demo_model_dir()
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                          LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    state = {k: torch.zeros_like(v) for k, v in get_peft_model_state_dict(peft).items()}
    cluster = Cluster(tmp_path_factory.mktemp("bad-input"), str(model_dir),
                      workflow_replicas=0, sandbox_replicas=0, learner=False, max_lora_rank=8)
    endpoints = cluster.start()
    try:
        (address,) = endpoints["inference"]
        channel = grpc.insecure_channel(address, options=[
            ("grpc.max_send_message_length", 64 << 20)])
        s = inference_pb2_grpc.InferenceStub(channel)
        base = s.GetInfo(inference_pb2.GetInfoRequest(), timeout=10).base_model
        payload = adapter_io.serialize(state)
        manifest = adapter_io.make_manifest(ADAPTER.name, 0, base, 4, 8.0, TARGETS, payload)
        assert s.PushAdapter(adapter_io.chunks(manifest, payload), timeout=60).loaded
        yield s, base, payload
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def stub(
    replica: tuple[inference_pb2_grpc.InferenceStub, str, bytes],
) -> inference_pb2_grpc.InferenceStub:
    return replica[0]


def request(ids: list[int] | None = None, **sampling: Any) -> inference_pb2.GenerateRequest:
    sampling.setdefault("max_tokens", 4)
    return inference_pb2.GenerateRequest(
        prompt_token_ids=ids or [5, 6, 7], adapter=ADAPTER,
        sampling=inference_pb2.SamplingParams(**sampling))


def code_and_details(stub: inference_pb2_grpc.InferenceStub,
                     req: inference_pb2.GenerateRequest) -> tuple[grpc.StatusCode, str]:
    try:
        stub.Generate(req, timeout=30)
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


def test_one_bad_request_does_not_fail_the_good_ones_batched_with_it(stub: Any) -> None:
    vocab = model_limits(str(demo_model_dir())).vocab_size
    reqs = [request(seed=i + 1, temperature=1.0) for i in range(8)]
    reqs.insert(3, request([5, vocab + 7, 6]))
    with ThreadPoolExecutor(len(reqs)) as pool:
        results = list(pool.map(lambda r: code_and_details(stub, r), reqs))
    code, details = results.pop(3)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_token_ids[1]" in details and "vocabulary" in details
    assert [c for c, _ in results] == [grpc.StatusCode.OK] * 8


def test_generate_many_answers_each_request_as_generate_does(stub: Any) -> None:
    """GenerateMany (the workers' batched Generate): greedy requests get Generate's tokens,
    and a refused one gets Generate's code and message while the rest are served."""
    vocab = model_limits(str(demo_model_dir())).vocab_size
    good = [request([5 + i, 6, 7 + i], max_tokens=3 + i, temperature=0.0) for i in range(4)]
    refused = [request([5, vocab + 7, 6]),
               inference_pb2.GenerateRequest(prompt_token_ids=[5, 6], adapter=common_pb2.AdapterRef(
                   name="bad-input/never-pushed", version=3), sampling=good[0].sampling)]
    batch = [good[0], refused[0], good[1], good[2], refused[1], good[3]]
    outcomes = [o for message in stub.GenerateMany(
        inference_pb2.GenerateManyRequest(requests=batch), timeout=60) for o in message.outcomes]
    by_index = {o.index: o for o in outcomes}
    assert sorted(by_index) == list(range(len(batch))) and len(outcomes) == len(batch)
    for i, req in enumerate(batch):
        o = by_index[i]
        if req in refused:
            code, details = code_and_details(stub, req)
            assert (o.code, o.error) == (code.value[0], details), (i, o)
            assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
        else:
            alone = stub.Generate(req, timeout=30)
            assert o.code == 0 and list(o.response.token_ids) == list(alone.token_ids), i
            assert len(o.response.token_ids) == len(o.response.logprobs) <= req.sampling.max_tokens
            assert o.response.served_by == ADAPTER


def test_generate_many_refuses_an_oversized_call(stub: Any) -> None:
    from services.inference.server import MAX_GENERATE_MANY

    many = inference_pb2.GenerateManyRequest(requests=[request()] * (MAX_GENERATE_MANY + 1))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.GenerateMany(many, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"requests: at most {MAX_GENERATE_MANY}" in (err.value.details() or "")


@pytest.mark.parametrize("sampling, field", [
    ({"temperature": math.nan}, "sampling.temperature"),
    ({"temperature": math.inf}, "sampling.temperature"),
    ({"temperature": -1.0}, "sampling.temperature"),
    ({"temperature": 1e300}, "sampling.temperature"),
    ({"top_p": math.nan}, "sampling.top_p"),
    ({"top_p": -0.5}, "sampling.top_p"),
    ({"top_p": 7.0}, "sampling.top_p"),
    ({"max_tokens": 2**31 - 1}, "sampling.max_tokens"),
    ({"max_tokens": -3}, "sampling.max_tokens"),
    ({"seed": -5}, "sampling.seed"),
    ({"stop_token_ids": [-1]}, "sampling.stop_token_ids[0]"),
    ({"temperature": math.nan, "max_tokens": 2**31 - 1}, "sampling.max_tokens"),
])
def test_bad_sampling_is_refused_and_the_replica_keeps_serving(
        stub: Any, sampling: dict[str, Any], field: str) -> None:
    code, details = code_and_details(stub, request(**sampling))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert details.startswith(field), details
    assert code_and_details(stub, request())[0] == grpc.StatusCode.OK


def test_prompt_that_fills_the_context_is_refused_and_generation_ends_there(stub: Any) -> None:
    context = model_limits(str(demo_model_dir())).context
    code, details = code_and_details(stub, request([5] * context))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "context" in details
    reply = stub.Generate(request([5] * (context - 3), max_tokens=500, temperature=1.0, seed=1,
                                  stop_token_ids=[]), timeout=60)
    assert len(reply.token_ids) <= 3  # the budget was cut at the context's end


def test_an_error_echoing_a_huge_input_arrives_cut_not_as_stream_removed(stub: Any) -> None:
    req = request()
    req.adapter.name = "x" * 200_000  # named back in "adapter ... is not loaded"
    code, details = code_and_details(stub, req)
    assert code == grpc.StatusCode.FAILED_PRECONDITION, details
    assert "more bytes cut" in details and len(details.encode()) <= MAX_DETAILS_BYTES
    req = request()
    req.request_id = "y" * 100_000
    code, details = code_and_details(stub, req)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("request_id")


def test_check_request_names_each_field() -> None:
    limits = ModelLimits(context=16, vocab_size=10)
    ok = GenerationRequest([1, 2], "k", max_tokens=14)
    check_request(ok, limits)
    for change, field in [({"prompt_token_ids": []}, "prompt_token_ids"),
                          ({"prompt_token_ids": [1, 10]}, "prompt_token_ids[1]"),
                          ({"max_tokens": 0}, "sampling.max_tokens"),
                          ({"max_tokens": (1 << 20) + 1}, "sampling.max_tokens"),
                          ({"temperature": math.nan}, "sampling.temperature"),
                          ({"top_p": math.inf}, "sampling.top_p"),
                          ({"seed": 1 << 63}, "sampling.seed"),
                          ({"stop_token_ids": [1] * 257}, "sampling.stop_token_ids")]:
        bad = GenerationRequest(**{**ok.__dict__, **change})
        with pytest.raises(ValueError, match="^" + re.escape(field)):
            check_request(bad, limits)


def test_engine_failure_stays_with_its_own_request() -> None:
    """A request that fails inside the engine (here: one that skipped the checks) fails
    alone; the requests batched with it are decoded."""
    from marl.spec.services import InferenceConfig
    from services.inference.transformers_engine import BASE, TransformersEngine

    engine = TransformersEngine(InferenceConfig(model=str(demo_model_dir())), batch_wait_s=0.05)
    vocab = engine.base.config.vocab_size

    async def run() -> list[Any]:
        reqs = [GenerationRequest([5, 6], BASE, max_tokens=3, seed=i + 1) for i in range(4)]
        reqs.insert(2, GenerationRequest([5, vocab + 100], BASE, max_tokens=3))
        try:
            return await asyncio.gather(*(engine.generate(r) for r in reqs),
                                        return_exceptions=True)
        finally:
            await engine.close()

    results = asyncio.run(run())
    assert isinstance(results.pop(2), Exception)
    assert all(len(r.token_ids) == 3 for r in results), results


def test_info_says_a_batch_mixes_any_number_of_adapters(stub: Any) -> None:
    info = stub.GetInfo(inference_pb2.GetInfoRequest(), timeout=10)
    assert (info.engine, info.lora_slots) == ("transformers", 0)


def test_a_push_keeps_the_versions_its_manifest_asks_for(
    replica: tuple[inference_pb2_grpc.InferenceStub, str, bytes],
) -> None:
    """The replica keeps 2 versions of an adapter by its own setting; a run with
    train.max_staleness 2 asks for 3, and a version 2 pushes old still serves. A push
    asking for more than the replica allows is refused, naming the field."""
    s, base, payload = replica
    name = "keep/p"

    def push(version: int, keep: int) -> None:
        manifest = adapter_io.make_manifest(
            name, version, base, 4, 8.0, TARGETS, payload, keep_versions=keep)
        assert s.PushAdapter(adapter_io.chunks(manifest, payload), timeout=60).loaded

    def loaded() -> list[int]:
        listed = s.ListAdapters(inference_pb2.ListAdaptersRequest(), timeout=10).adapters
        return sorted(a.ref.version for a in listed if a.ref.name == name)

    for version in (1, 2, 3):
        push(version, keep=3)
    assert loaded() == [1, 2, 3]
    first = inference_pb2.GenerateRequest(
        prompt_token_ids=[5, 6, 7], adapter=common_pb2.AdapterRef(name=name, version=1),
        sampling=inference_pb2.SamplingParams(max_tokens=2))
    assert s.Generate(first, timeout=30).served_by.version == 1
    push(4, keep=0)  # back to the replica's own 2
    assert loaded() == [3, 4]
    code, details = code_and_details(s, first)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "keep/p@1 is not loaded" in details

    too_many = adapter_io.make_manifest(
        name, 5, base, 4, 8.0, TARGETS, payload, keep_versions=65)
    with pytest.raises(grpc.RpcError) as err:
        s.PushAdapter(adapter_io.chunks(too_many, payload), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "manifest.keep_versions 65 is outside 0..64" in (err.value.details() or "")
    assert loaded() == [3, 4]
