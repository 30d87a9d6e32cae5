"""A base model wrapped by PEFT with the RunSpec's LoRA: the learner's policy, the step-0
adapters of `marl episode`, and `marl eval`'s zero adapters all build it here, each LoRA
layer adding its low-rank term inside one GEMM (`fuse_lora_adds`)."""

from __future__ import annotations

import warnings
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from marl.spec.run import LoraSpec

if TYPE_CHECKING:
    from peft import PeftModel


def with_lora(base: Any, lora: LoraSpec, adapter_name: str = "default") -> PeftModel:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # PEFT accepts floats
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        bias="none",
    )
    with warnings.catch_warnings():
        # PEFT reads transformers' deprecated `is_gradient_checkpointing` while wrapping:
        # not the user's to act on
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        model = get_peft_model(base, config, adapter_name=adapter_name)
    fuse_lora_adds(model)
    return model


LAYER_ATTRIBUTES = ("active_adapters", "disable_adapters", "merged", "lora_A", "lora_B",
                    "lora_variant", "lora_dropout", "scaling", "base_layer", "_cast_input_dtype")
"""What `_fused_forward` reads of a PEFT LoRA layer (some of it PEFT's private API)."""


def fuse_lora_adds(model: Any) -> int:
    """Make each of `model`'s PEFT LoRA linear layers add its low-rank term inside one GEMM:
    `addmm(W x, A x, Bᵀ, alpha=scaling)` in place of PEFT's `W x + B(A x) * scaling`.

    Same arithmetic, but the scaling and the sum no longer make two element-wise passes
    over the layer's whole output forward and one backward; on the demo model those
    passes (outputs of up to 512 features, a LoRA of rank 16) cost about a tenth of a
    GRPO step. A layer falls back to PEFT's own forward whenever it is in a state this
    does not cover: adapters disabled or merged, more than one active adapter, a LoRA
    variant (DoRA...), a bias on B, or extra forward arguments. A PEFT whose layers lack
    the attributes this reads (`LAYER_ATTRIBUTES`, checked against 0.21) keeps its own
    forward. Returns the number of fused layers (a layer fused already stays as it is)."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    fused = 0
    for module in model.modules():
        if type(module) is not LoraLinear or not all(
            hasattr(module, name) for name in LAYER_ATTRIBUTES
        ):
            continue
        forward = module.__dict__.get("forward")
        if not (isinstance(forward, partial) and forward.func is _fused_forward):
            module.forward = partial(_fused_forward, module, module.forward)  # type: ignore[method-assign]
        fused += 1
    return fused


def _fused_forward(layer: Any, peft_forward: Any, x: torch.Tensor, *args: Any,
                   **kwargs: Any) -> torch.Tensor:
    active = layer.active_adapters
    if (args or kwargs or layer.disable_adapters or layer.merged or len(active) != 1
            or active[0] not in layer.lora_A or active[0] in layer.lora_variant
            or layer.lora_B[active[0]].bias is not None):
        return peft_forward(x, *args, **kwargs)  # type: ignore[no-any-return]
    name = active[0]
    a, b = layer.lora_A[name], layer.lora_B[name]
    result = layer.base_layer(x)
    low = torch.nn.functional.linear(
        layer.lora_dropout[name](layer._cast_input_dtype(x, a.weight.dtype)), a.weight
    )
    total = torch.addmm(
        result.reshape(-1, result.shape[-1]).to(low.dtype),
        low.reshape(-1, low.shape[-1]),
        b.weight.t(),
        alpha=layer.scaling[name],
    )
    return total.view(result.shape).to(result.dtype)
