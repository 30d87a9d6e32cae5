"""The transformers engine's multi-adapter layers against PEFT's mixed-adapter forward."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
from transformers import Qwen3ForCausalLM

from services.inference.multi_lora import MultiLoRA, plan_for
from tests.support.lora_models import TARGETS, adapter, tiny_model


def peft_logits(model: Qwen3ForCausalLM, adapters: dict[str, tuple[int, dict[str, torch.Tensor]]],
                ids: torch.Tensor, rows: list[str | None]) -> torch.Tensor:
    peft = None
    for name, (rank, state) in adapters.items():
        config = LoraConfig(r=rank, lora_alpha=16, target_modules=TARGETS)
        if peft is None:
            peft = get_peft_model(copy.deepcopy(model), config, adapter_name=name)
        else:
            peft.add_adapter(name, config)
        set_peft_model_state_dict(peft, state, adapter_name=name)
    assert peft is not None
    peft.eval()
    with torch.no_grad():
        return peft(input_ids=ids, adapter_names=[r or "__base__" for r in rows]).logits


def ours_logits(model: Qwen3ForCausalLM, adapters: dict[str, tuple[int, dict[str, torch.Tensor]]],
                ids: torch.Tensor, rows: list[str | None]) -> torch.Tensor:
    mine = copy.deepcopy(model)
    lora = MultiLoRA(mine)
    for name, (rank, state) in adapters.items():
        lora.load(name, rank, 16.0, TARGETS, state)
    with torch.no_grad(), lora.route(rows):
        return mine(input_ids=ids).logits


@pytest.mark.parametrize(
    "ranks, rows",
    [
        ([8, 8, 8], ["a0", "a0", "a1", "a1", "a2", "a2"]),  # one bmm for all adapters
        ([8, 8], [None, "a0", "a0", "a0", "a1"]),  # uneven groups and base rows
        ([4, 8], ["a0", "a0", "a1", "a1"]),  # even groups of unequal ranks
        ([8, 8], ["a1", "a0", "a1", "a0"]),  # unsorted rows
    ],
)
def test_logits_equal_peft_mixed_batch(ranks: list[int], rows: list[str | None]) -> None:
    model = tiny_model()
    adapters = {f"a{i}": (r, adapter(model, r, 10 + i)) for i, r in enumerate(ranks)}
    ids = torch.randint(0, 50, (len(rows), 7), generator=torch.Generator().manual_seed(1))
    want = peft_logits(model, adapters, ids, rows)
    got = ours_logits(model, adapters, ids, rows)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    base = model(input_ids=ids).logits
    for i, name in enumerate(rows):
        if name is None:
            torch.testing.assert_close(got[i], base[i].detach(), rtol=1e-6, atol=1e-6)
        else:
            assert (got[i] - base[i]).abs().max() > 1e-3


def test_plan_groups_rows_and_finds_the_uniform_case() -> None:
    plan = plan_for(["a", "a", "b", "b"])
    assert plan.groups == [("a", 0, 2), ("b", 2, 4)]
    assert plan.uniform == ("a", "b")
    assert plan_for([None, "a"]).uniform is None
    assert plan_for(["a", "b", "b"]).uniform is None
    assert plan_for(["a", "b", "a"]).groups == [("a", 0, 1), ("b", 1, 2), ("a", 2, 3)]
    assert plan_for(["a", "b", "a"]).uniform is None
    assert plan_for(["a", "a"]).uniform == ("a",)


def test_unloaded_adapter_leaves_the_base_model() -> None:
    model = tiny_model()
    ids = torch.tensor([[1, 2, 3]])
    base = model(input_ids=ids).logits.detach()
    mine = copy.deepcopy(model)
    lora = MultiLoRA(mine)
    lora.load("a", 8, 16.0, TARGETS, adapter(model, 8, 3))
    lora.unload("a")
    with torch.no_grad():
        torch.testing.assert_close(mine(input_ids=ids).logits, base)
    with pytest.raises(KeyError, match="adapter a is not loaded"), lora.route(["a"]):
        pass


def test_bad_weights_are_refused_and_nothing_is_loaded() -> None:
    model = tiny_model()
    lora = MultiLoRA(model)
    good = adapter(model, 8, 4)
    renamed = {k.replace("q_proj", "qq_proj"): v for k, v in good.items()}
    with pytest.raises(ValueError, match="unexpected weights"):
        lora.load("x", 8, 16.0, TARGETS, renamed)
    with pytest.raises(ValueError, match="unexpected weights"):
        lora.load("x", 8, 16.0, ["v_proj"], good)  # q_proj's weights, not a target
    with pytest.raises(ValueError, match="do not fit rank 4"):
        lora.load("x", 4, 16.0, TARGETS, good)
    half = {k: v for k, v in good.items() if "q_proj.lora_B" not in k}
    with pytest.raises(ValueError, match="only one of lora_A and lora_B"):
        lora.load("x", 8, 16.0, TARGETS, half)
    assert lora.loaded == {} and lora.layers == {}
    lora.load("x", 8, 16.0, TARGETS, good)
    with pytest.raises(ValueError, match="already loaded"):
        lora.load("x", 8, 16.0, TARGETS, good)
