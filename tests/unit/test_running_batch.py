"""Continuous batching: rows that join a running batch, or leave it, decode exactly as alone."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.inference.engine import GenerationRequest
from services.inference.multi_lora import MultiLoRA
from services.inference.running_batch import (
    Row,
    RunningBatch,
    cache_argument,
    decode_all,
    make_row,
)
from tests.support.lora_models import TARGETS, adapter, tiny_model

EOS: list[int] = []  # the random model may emit any token: decode to each row's budget


@pytest.fixture(scope="module")
def model_and_lora() -> tuple[torch.nn.Module, MultiLoRA]:
    model = tiny_model()
    weights = {"a": (4, adapter(model, 4, seed=1)), "b": (8, adapter(model, 8, seed=2))}
    lora = MultiLoRA(model)
    for name, (rank, state) in weights.items():
        lora.load(name, rank, 16.0, TARGETS, state)
    return model, lora


def request(prompt: list[int], max_tokens: int, adapter: str | None = None,
            temperature: float = 0.0, seed: int | None = None) -> GenerationRequest:
    return GenerationRequest(prompt, adapter or "__base__", max_tokens, temperature, seed=seed)


def alone(model_and_lora: tuple[torch.nn.Module, MultiLoRA], req: GenerationRequest,
          adapter: str | None) -> tuple[list[int], list[float]]:
    model, lora = model_and_lora
    result = decode_all(model, lora, [req], [adapter], EOS, pad_token_id=0)[0]
    return result.token_ids, result.logprobs


def test_rows_joining_mid_batch_decode_as_alone(
        model_and_lora: tuple[torch.nn.Module, MultiLoRA]) -> None:
    """Rows of three adapters join at steps 0, 3 and 5 with prompts shorter and longer than
    the batch's cache; each one's tokens and log-probs match its decode alone."""
    model, lora = model_and_lora
    plan: list[tuple[int, GenerationRequest, str | None]] = [
        (0, request([3, 4, 5], 12, "b"), "b"),
        (0, request([7, 8], 9), None),
        (3, request([9, 10, 11, 12, 13, 14, 15, 16, 17], 6, "a"), "a"),
        (3, request([20], 8, "b", temperature=1.0, seed=11), "b"),
        (5, request([21, 22, 23, 24], 7, "a", temperature=0.7, seed=5), "a"),
    ]
    batch = RunningBatch(model, lora, pad_token_id=0)
    rows: list[Row] = []
    finished: list[Row] = []
    step = 0
    while step == 0 or batch.rows:
        joining = [make_row(r, a, EOS) for at, r, a in plan if at == step]
        if joining:
            finished += batch.admit(joining)
            rows += joining
        assert [r.order_key for r in batch.rows] == sorted(r.order_key for r in batch.rows)
        finished += batch.step()
        step += 1
    assert len(finished) == len(plan)
    for (_, req, name), row in zip(plan, rows, strict=True):
        tokens, logprobs = alone(model_and_lora, req, name)
        assert row.tokens == tokens
        assert row.finish == "length" and len(tokens) == req.max_tokens
        assert row.logprobs == pytest.approx(logprobs, abs=1e-4)


def test_a_finished_row_leaves_and_its_padding_is_trimmed(
        model_and_lora: tuple[torch.nn.Module, MultiLoRA]) -> None:
    model, lora = model_and_lora
    batch = RunningBatch(model, lora, pad_token_id=0)
    long_prompt, short = request(list(range(1, 11)), 3), request([5, 6], 8)
    batch.admit([make_row(long_prompt, None, EOS),
                 make_row(short, None, EOS)])
    assert batch._state is not None and batch._state.mask.shape == (2, 10)
    assert batch.step() == []
    (done,) = batch.step()
    assert done.request is long_prompt and len(done.tokens) == 3
    # the short prompt's row kept: 2 prompt tokens + 2 fed tokens, no leading padding
    assert [r.request for r in batch.rows] == [short]
    assert batch._state.mask.shape == (1, 4) and bool(batch._state.mask.all())
    while batch.rows:
        batch.step()
    assert done.tokens == alone(model_and_lora, long_prompt, None)[0]


def test_a_row_that_finishes_on_its_first_token_never_joins(
        model_and_lora: tuple[torch.nn.Module, MultiLoRA]) -> None:
    model, lora = model_and_lora
    batch = RunningBatch(model, lora, pad_token_id=0)
    one = make_row(request([1, 2], 1, "a"), "a", EOS)
    assert batch.admit([one]) == [one] and batch.rows == []
    assert one.finish == "length" and len(one.tokens) == 1


def test_a_stop_token_ends_its_row_only(
        model_and_lora: tuple[torch.nn.Module, MultiLoRA]) -> None:
    model, lora = model_and_lora
    first, _ = alone(model_and_lora, request([3, 4, 5], 6), None)
    stopper = GenerationRequest([3, 4, 5], "__base__", 6, 0.0, stop_token_ids=[first[2]])
    batch = RunningBatch(model, lora, pad_token_id=0)
    rows = [make_row(stopper, None, EOS),
            make_row(request([3, 4, 5], 6), None, EOS)]
    batch.admit(rows)
    while batch.rows:
        batch.step()
    assert rows[0].finish == "stop" and rows[0].tokens == first[: first.index(first[2]) + 1]
    assert rows[1].finish == "length" and rows[1].tokens == first


def test_engine_admits_a_request_into_a_running_batch(tiny_model_dir: object) -> None:
    """A short request sent while a long one decodes returns first; an adapter load is
    served between two decode steps, not after the batch."""
    from marl.spec.services import InferenceConfig
    from services.inference.engine import AdapterWeights
    from services.inference.transformers_engine import BASE, TransformersEngine

    engine = TransformersEngine(InferenceConfig(model=str(tiny_model_dir), device="cpu"))
    engine.eos_token_ids = []
    long_req = GenerationRequest([5, 6, 7], BASE, max_tokens=400, temperature=0.0)
    state = adapter(engine.base, 4, seed=0)

    async def run() -> tuple[list[str], int, int]:
        order: list[str] = []
        long_task = asyncio.create_task(engine.generate(long_req))
        long_task.add_done_callback(lambda _: order.append("long"))
        while not engine._batch.rows:
            await asyncio.sleep(0.001)
        short = await engine.generate(GenerationRequest([9], BASE, max_tokens=2))
        order.append("short")
        await engine.load_adapter(AdapterWeights("r/p@1", 1, 4, 16.0, TARGETS, state))
        order.append("loaded")
        long = await long_task
        await engine.close()
        return order, len(short.token_ids), len(long.token_ids)

    order, short_len, long_len = asyncio.run(run())
    assert order == ["short", "loaded", "long"]
    assert (short_len, long_len) == (2, 400)


def test_rows_sharing_a_prompt_and_adapter_are_prefilled_once(
        model_and_lora: tuple[torch.nn.Module, MultiLoRA]) -> None:
    """A group's samples (same prompt, same adapter) share one prefill row; each still
    samples on its own and decodes exactly as alone."""
    model, lora = model_and_lora
    prompt = [3, 4, 5, 6]
    plan: list[tuple[GenerationRequest, str | None]] = [
        (request(prompt, 6, "a", temperature=1.0, seed=1), "a"),
        (request(prompt, 6, "a", temperature=1.0, seed=2), "a"),
        (request(prompt, 5, "a", temperature=0.0), "a"),
        (request(prompt, 6, "b", temperature=1.0, seed=1), "b"),
        (request([9, 8], 4, "a"), "a"),
    ]
    widths: list[tuple[int, ...]] = []
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kwargs: widths.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        batch = RunningBatch(model, lora, pad_token_id=0)
        rows = [make_row(r, a, EOS) for r, a in plan]
        batch.admit(rows)
        while batch.rows:
            batch.step()
    finally:
        hook.remove()
    assert widths[0] == (3, 4)  # (a, prompt), (a, [9, 8]), (b, prompt)
    assert all(w[0] <= 5 and w[1] == 1 for w in widths[1:])
    for (req, name), row in zip(plan, rows, strict=True):
        tokens, logprobs = alone(model_and_lora, req, name)
        assert row.tokens == tokens
        assert row.logprobs == pytest.approx(logprobs, abs=1e-4)
    assert rows[0].tokens != rows[1].tokens  # seeds 1 and 2 sample apart


def test_the_kv_cache_goes_by_the_name_the_model_forward_takes() -> None:
    """transformers 5.24 renamed `past_key_values` to `cache` (the old name warns, and goes
    in 5.40); the project allows 5.2 on, so the batch asks the model which it takes."""

    class Before(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, past_key_values: object = None) -> None:
            pass

    class After(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, cache: object = None) -> None:
            pass

    assert cache_argument(Before()) == "past_key_values"
    assert cache_argument(After()) == "cache"
