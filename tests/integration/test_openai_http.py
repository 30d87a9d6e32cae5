"""The inference replica's OpenAI-compatible endpoint, driven by the real `openai` client.

One real `marl serve inference` process (transformers engine, the demo model
that ships with marl) started by the launcher with its HTTP port. Two adapters are
pushed over gRPC: `it-openai/zero@0` (B = 0, so it computes exactly the base
model, as every run's version 0 does) and `it-openai/gen@3` (random weights).
"Same tokens as gRPC": the HTTP answer and a gRPC `Generate` with the same
prompt ids and seed give the same token ids and log-probs; the base model's
HTTP answer equals gRPC on the zero adapter (gRPC serves adapters only).

Every test runs on the transformers engine; the `vllm` cases run the same
tests on vLLM from `.venv-vllm` (`make test-vllm`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import torch

from marl.local.launcher import Cluster
from marl.models.demo import demo_model_dir
from marl.protocol import adapter_io
from marl.protocol.openai import render_chat
from marl.protocol.v1 import common_pb2, inference_pb2, inference_pb2_grpc

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[2]
TARGETS = ["q_proj", "v_proj"]
RANK, ALPHA = 8, 16.0
ADAPTER, ZERO = "it-openai/gen@3", "it-openai/zero@0"
PROMPT = "What is 2 plus 3 ?"


@dataclass
class Replica:
    url: str
    stub: inference_pb2_grpc.InferenceStub
    base_id: str
    tokenizer: Any
    client: openai.OpenAI


def _push(stub: inference_pb2_grpc.InferenceStub, ref: str, base_model: str,
          shapes: dict[str, tuple[int, ...]], zero_b: bool) -> None:
    name, version = ref.split("@")
    gen = torch.Generator().manual_seed(3)
    state = {k: (torch.zeros(s) if zero_b and "lora_B" in k else torch.randn(s, generator=gen))
             for k, s in shapes.items()}
    payload = adapter_io.serialize(state)
    manifest = adapter_io.make_manifest(name, int(version), base_model, RANK, ALPHA, TARGETS,
                                        payload)
    assert stub.PushAdapter(adapter_io.chunks(manifest, payload), timeout=60).loaded


@pytest.fixture(scope="module",
                params=["transformers", pytest.param("vllm", marks=pytest.mark.vllm)])
def replica(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Replica]:
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = demo_model_dir()
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    peft = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS))
    shapes = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(peft).items()}
    cluster = Cluster(tmp_path_factory.mktemp("openai-cluster"), str(model_dir),
                      engine=request.param, workflow_replicas=0, sandbox_replicas=0,
                      learner=False, max_lora_rank=RANK)
    endpoints = cluster.start()
    try:
        (address,) = endpoints["inference"]
        (http,) = endpoints["inference_http"]
        stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(address))
        base_id = stub.GetInfo(inference_pb2.GetInfoRequest(), timeout=10).base_model
        _push(stub, ADAPTER, base_id, shapes, zero_b=False)
        _push(stub, ZERO, base_id, shapes, zero_b=True)
        client = openai.OpenAI(base_url=f"http://{http}/v1", api_key="unused", max_retries=0,
                               timeout=120)
        yield Replica(f"http://{http}", stub, base_id,
                      AutoTokenizer.from_pretrained(model_dir), client)
    finally:
        cluster.stop()


def grpc_generate(replica: Replica, ref: str, prompt_ids: list[int], seed: int,
                  max_tokens: int, temperature: float) -> inference_pb2.GenerateResponse:
    name, version = ref.split("@")
    return replica.stub.Generate(inference_pb2.GenerateRequest(
        prompt_token_ids=prompt_ids,
        adapter=common_pb2.AdapterRef(name=name, version=int(version)),
        sampling=inference_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                              seed=seed)), timeout=120)


def test_models_lists_base_and_loaded_adapters(replica: Replica) -> None:
    ids = [m.id for m in replica.client.models.list()]
    assert ids[0] == replica.base_id
    assert set(ids[1:]) == {ADAPTER, ZERO}


@pytest.mark.parametrize("model", ["adapter", "base"])
def test_completion_has_the_tokens_of_grpc_generate(replica: Replica, model: str) -> None:
    name = ADAPTER if model == "adapter" else replica.base_id
    grpc_ref = ADAPTER if model == "adapter" else ZERO
    resp = replica.client.completions.create(
        model=name, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=1234, logprobs=0,
        extra_body={"return_token_ids": True})
    (choice,) = resp.choices
    extra: dict[str, Any] = choice.model_extra or {}
    prompt_ids = list(replica.tokenizer.encode(PROMPT))
    assert extra["prompt_token_ids"] == prompt_ids
    want = grpc_generate(replica, grpc_ref, prompt_ids, 1234, 12, 1.0)
    assert extra["token_ids"] == list(want.token_ids)
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert choice.logprobs.token_logprobs == pytest.approx(list(want.logprobs), abs=1e-5)
    assert choice.text == replica.tokenizer.decode(list(want.token_ids),
                                                    skip_special_tokens=True)
    assert choice.finish_reason == want.finish_reason
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.usage.completion_tokens == len(want.token_ids)


@pytest.mark.parametrize("model", ["adapter", "base"])
def test_chat_completion_has_the_tokens_of_grpc_generate(replica: Replica, model: str) -> None:
    name = ADAPTER if model == "adapter" else replica.base_id
    grpc_ref = ADAPTER if model == "adapter" else ZERO
    messages = [{"role": "system", "content": "Answer in boxed"},
                {"role": "user", "content": PROMPT}]
    resp = replica.client.chat.completions.create(
        model=name, messages=messages,  # type: ignore[arg-type]
        max_tokens=12, temperature=0.8, seed=99, logprobs=True,
        extra_body={"return_token_ids": True})
    (choice,) = resp.choices
    prompt_ids = render_chat(replica.tokenizer, messages)
    assert (resp.model_extra or {})["prompt_token_ids"] == prompt_ids
    want = grpc_generate(replica, grpc_ref, prompt_ids, 99, 12, 0.8)
    assert (choice.model_extra or {})["token_ids"] == list(want.token_ids)
    assert choice.message.role == "assistant"
    assert choice.message.content == replica.tokenizer.decode(list(want.token_ids),
                                                               skip_special_tokens=True)
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(list(want.logprobs),
                                                                         abs=1e-5)


def test_adapter_and_base_differ_and_n_samples_differ(replica: Replica) -> None:
    def tokens(model: str, n: int = 1) -> list[list[int]]:
        resp = replica.client.completions.create(
            model=model, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=5, n=n,
            extra_body={"return_token_ids": True})
        return [(c.model_extra or {})["token_ids"] for c in resp.choices]

    assert tokens(ADAPTER) != tokens(replica.base_id)
    four = tokens(ADAPTER, n=4)
    assert len(four) == 4 and four[0] == tokens(ADAPTER)[0]
    assert len({tuple(t) for t in four}) > 1


def test_unknown_model_is_not_found(replica: Replica) -> None:
    for model in ("it-openai/gen@4", "it-openai/nope@0", "gpt-4o"):
        with pytest.raises(openai.NotFoundError, match="not served here"):
            replica.client.completions.create(model=model, prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        replica.client.chat.completions.create(
            model="it-openai/gen@4", messages=[{"role": "user", "content": PROMPT}])


@pytest.mark.parametrize("params, field", [
    ({"temperature": -1}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10**6}, "max_tokens"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"logprobs": 3}, "logprobs"),
    ({"stop": [""]}, "stop"),
    ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
])
def test_bad_parameter_is_bad_request(replica: Replica, params: dict[str, Any],
                                      field: str) -> None:
    args: dict[str, Any] = {"model": ADAPTER, "prompt": PROMPT, "max_tokens": 4, **params}
    with pytest.raises(openai.BadRequestError) as err:
        replica.client.completions.create(**args)
    assert err.value.body is not None
    assert isinstance(err.value.body, dict) and err.value.body.get("param") == field
    assert str(err.value.message).count(field) >= 1


def test_bad_chat_parameter_is_bad_request(replica: Replica) -> None:
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.role"):
        replica.client.chat.completions.create(
            model=ADAPTER, messages=[{"role": "robot", "content": "hi"}])  # type: ignore[misc]
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        replica.client.chat.completions.create(
            model=ADAPTER, messages=[{"role": "user", "content": "hi"}], logprobs=True,
            top_logprobs=2)


def test_stop_string_ends_the_text(replica: Replica) -> None:
    def sample(seed: int, stop: list[str] | None = None) -> Any:
        return replica.client.completions.create(
            model=ADAPTER, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=seed, stop=stop,
            extra_body={"return_token_ids": True}).choices[0]

    for seed in range(1, 40):  # a seeded sample whose third token is visible text
        full = sample(seed)
        ids = (full.model_extra or {})["token_ids"]
        stop = replica.tokenizer.decode(ids[2:3], skip_special_tokens=True)
        if len(ids) >= 3 and stop:
            break
    else:
        pytest.fail("no seed gave a sample of 3 visible tokens")
    cut = sample(seed, [stop])
    assert cut.finish_reason == "stop"
    assert stop not in cut.text
    assert full.text.startswith(cut.text)
    cut_ids = (cut.model_extra or {})["token_ids"]
    assert cut_ids == ids[: len(cut_ids)] and len(cut_ids) <= 3


def test_generate_cli(replica: Replica) -> None:
    want = replica.client.completions.create(model=ADAPTER, prompt=PROMPT, max_tokens=8,
                                             temperature=0).choices[0].text
    env = {**os.environ, "MARL_INFERENCE_HTTP": replica.url}
    out = subprocess.run([sys.executable, "-m", "marl.cli", "generate", "--model", ADAPTER,
                          "--max-tokens", "8", PROMPT], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == want + "\n"
    missing = subprocess.run([sys.executable, "-m", "marl.cli", "generate", "--model",
                              "it-openai/gen@77", PROMPT], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "it-openai/gen@77" in missing.stderr
