"""`fuse_lora_adds`: PEFT's LoRA layers computing their sum inside one GEMM give PEFT's
own outputs and gradients, in every adapter state the learner uses."""

from __future__ import annotations

import copy
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from marl.models.lora import fuse_lora_adds, lora_on_rows, rows_maskable, with_lora
from marl.spec.run import LoraSpec

LORA = LoraSpec(rank=4, alpha=8.0)


def peft_and_fused(model_dir: Path, dtype: torch.dtype, lora: LoraSpec = LORA) -> tuple[Any, Any]:
    """The same PEFT model twice, B initialised away from PEFT's zeros so the LoRA term
    counts: the first with PEFT's forward put back, the second fused."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    fused = with_lora(base, lora, "one")
    fused.add_adapter("two", fused.peft_config["one"])
    for name, param in fused.named_parameters():
        if "lora_" in name:
            param.data = torch.randn_like(param, dtype=torch.float32) * 0.2
    peft = copy.deepcopy(fused)
    for module in peft.modules():
        module.__dict__.pop("forward", None)  # the class's, PEFT's own
    return peft, fused


def logits_and_grads(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    logits = model(ids).logits.float()
    (logits.square().mean() + logits[:, -1].sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def test_every_lora_layer_of_the_demo_architecture_is_fused(model_dir: Path) -> None:
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    model = with_lora(base, LORA)
    layers = base.config.num_hidden_layers * 7  # q k v o gate up down
    assert fuse_lora_adds(model) == layers  # with_lora fused them; a second call keeps them
    wrapped = [m.__dict__["forward"] for m in model.modules() if "forward" in m.__dict__]
    assert len(wrapped) == layers
    assert not any(isinstance(f.args[1], partial) for f in wrapped)  # PEFT's, not wrapped twice
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.profiler.profile() as prof:
        model(ids)
    addmms = sum(e.count for e in prof.key_averages() if e.key == "aten::addmm")
    assert addmms == layers


@pytest.mark.parametrize("adapter", ["one", "two"])
def test_fused_layers_give_peft_outputs_and_gradients(model_dir: Path, adapter: str) -> None:
    peft, fused = peft_and_fused(model_dir, torch.float32)
    ids = torch.randint(3, 30, (3, 17), generator=torch.Generator().manual_seed(1))
    for model in (peft, fused):
        model.set_adapter(adapter)
    want_logits, want_grads = logits_and_grads(peft, ids)
    got_logits, got_grads = logits_and_grads(fused, ids)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5)
    assert got_grads.keys() == want_grads.keys()
    assert any(adapter in name for name in got_grads)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    with peft.disable_adapter(), fused.disable_adapter():
        torch.testing.assert_close(fused(ids).logits, peft(ids).logits)
    # the LoRA term matters: without it the outputs differ (the check above can fail)
    with fused.disable_adapter():
        assert (fused(ids).logits - want_logits).abs().max() > 1e-2


def test_a_low_precision_base_computes_the_term_in_its_precision(model_dir: Path) -> None:
    """A bf16 base with fp32 LoRA weights, as the learner keeps them: PEFT casts each
    layer's activations to fp32 and back; the fused layer casts the small A and B to bf16
    instead (as autocast does). Against the same weights in float32, its outputs and
    gradients are no further off than PEFT's own bf16 ones (within a factor 2), and the
    gradients reach the fp32 weights in fp32."""
    peft, fused = peft_and_fused(model_dir, torch.bfloat16)
    exact, _ = peft_and_fused(model_dir, torch.float32)  # the same seed: the same weights
    ids = torch.randint(3, 30, (2, 9), generator=torch.Generator().manual_seed(2))
    want, want_grads = logits_and_grads(exact, ids)
    peft_logits, peft_grads = logits_and_grads(peft, ids)
    got, got_grads = logits_and_grads(fused, ids)
    assert fused(ids).logits.dtype == torch.bfloat16
    assert (got - peft_logits).abs().max() > 0  # not PEFT's arithmetic: the check can tell
    assert (got - want).abs().max() <= 2 * (peft_logits - want).abs().max()

    def worst(grads: dict[str, torch.Tensor]) -> float:
        return max(float((grads[n] - g).abs().max() / g.abs().max()) for n, g in want_grads.items())

    assert all(g.dtype == torch.float32 for g in got_grads.values())
    assert worst(got_grads) <= 2 * worst(peft_grads)


def test_dropout_draws_as_peft_does(model_dir: Path) -> None:
    peft, fused = peft_and_fused(model_dir, torch.float32, LoraSpec(rank=4, alpha=8.0, dropout=0.3))
    peft.train()
    fused.train()
    ids = torch.randint(3, 30, (2, 11), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(7)
    want = peft(ids).logits
    torch.manual_seed(7)
    got = fused(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_merged_adapters_fall_back_to_peft(model_dir: Path) -> None:
    peft, fused = peft_and_fused(model_dir, torch.float32)
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    want = peft(ids).logits
    fused.merge_adapter()
    torch.testing.assert_close(fused(ids).logits, want, rtol=1e-4, atol=1e-4)


def test_a_peft_without_what_the_fusion_reads_keeps_its_own_forward(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A later PEFT that renamed a layer attribute the fused forward reads."""
    from marl.models import lora as peft_lora

    monkeypatch.setattr(peft_lora, "LAYER_ATTRIBUTES",
                        (*peft_lora.LAYER_ATTRIBUTES, "renamed_in_a_later_peft"))
    model = with_lora(AutoModelForCausalLM.from_pretrained(model_dir), LORA)
    assert fuse_lora_adds(model) == 0
    assert not any("forward" in m.__dict__ for m in model.modules())
    model(torch.tensor([[3, 4, 5, 6]]))


def test_row_scales_give_the_adapter_and_the_base_in_one_forward(model_dir: Path) -> None:
    """lora_on_rows: a batch and its copy, scales 1 then 0, give the adapter's logits and
    the base's (PEFT's disable_adapter), row by row; a scale of 0.5 half the LoRA term."""
    peft, fused = peft_and_fused(model_dir, torch.float32)
    ids = torch.randint(3, 30, (3, 13), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = peft(ids).logits
        with peft.disable_adapter():
            want_base = peft(ids).logits
        assert rows_maskable(fused)
        with lora_on_rows(fused, torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])):
            both = fused(torch.cat([ids, ids])).logits
        assert (want - want_base).abs().max() > 1e-2  # the adapter counts
        torch.testing.assert_close(both[:3], want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(both[3:], want_base, rtol=1e-5, atol=1e-5)
        with lora_on_rows(fused, torch.tensor([0.5])):
            half = fused(ids[:1]).logits
        assert (half - want[:1]).abs().max() > 1e-3 and (half - want_base[:1]).abs().max() > 1e-3
        torch.testing.assert_close(fused(ids).logits, want, rtol=1e-5, atol=1e-5)  # scope ends


@pytest.mark.parametrize("state", ["merged", "unfused"])
def test_row_scales_refuse_a_layer_they_cannot_reach(model_dir: Path, state: str) -> None:
    """A merged adapter or a layer left unfused would add its LoRA term to every row:
    rows_maskable says so; a fused layer that falls back to PEFT's forward raises."""
    _, fused = peft_and_fused(model_dir, torch.float32)
    if state == "merged":
        fused.merge_adapter()
    else:
        next(m for m in fused.modules() if "forward" in m.__dict__).__dict__.pop("forward")
    assert not rows_maskable(fused)
    if state == "merged":
        with lora_on_rows(fused, torch.tensor([1.0, 0.0])), pytest.raises(RuntimeError, match="rows"):
            fused(torch.tensor([[3, 4, 5], [3, 4, 5]]))
