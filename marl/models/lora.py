"""A base model wrapped by PEFT with the RunSpec's LoRA: the learner's policy, the step-0
adapters of `marl episode`, and `marl eval`'s zero adapters all build it here, each LoRA
layer adding its low-rank term inside one GEMM (`fuse_lora_adds`)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
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
                    "lora_variant", "lora_dropout", "scaling", "base_layer")
"""What `_fused_forward` reads of a PEFT LoRA layer (some of it PEFT's private API)."""

LOW_PRECISION = (torch.bfloat16, torch.float16)
"""Base dtypes in which the fused layer computes the low-rank term too."""


def fuse_lora_adds(model: Any) -> int:
    """Make each of `model`'s PEFT LoRA linear layers add its low-rank term inside one GEMM:
    `addmm(W x, A x, Bᵀ, alpha=scaling)` in place of PEFT's `W x + B(A x) * scaling`.

    Same arithmetic, but the scaling and the sum no longer make two element-wise passes
    over the layer's whole output forward and one backward; on the demo model those
    passes (outputs of up to 512 features, a LoRA of rank 16) cost about a tenth of a
    GRPO step. On a bf16 (or fp16) base with fp32 adapter weights, the term is computed in
    the base's precision from the weights cast per forward, as autocast does: PEFT casts
    the layer's input and output activations to fp32 and back instead, three passes over
    activations per layer (tests/unit/test_peft_lora.py holds both to the same precision).
    A layer falls back to PEFT's own forward whenever it is in a state this
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
        if not _is_fused(module):
            module.forward = partial(_fused_forward, module, module.forward)  # type: ignore[method-assign]
        fused += 1
    return fused


ROW_SCALE = "marl_row_scale"
"""The attribute `lora_on_rows` sets on each fused layer: a module's own attribute, which
torch.compile traces, where a context variable would break its graph at every layer."""


@contextmanager
def lora_on_rows(model: Any, scale: torch.Tensor) -> Iterator[None]:
    """Within it, every fused LoRA layer of `model` scales its low-rank term by
    `scale[i]` on batch row i: a row of 0 sees the base model, a row of 1 the adapter. One
    forward over a batch and its copy then gives both the adapter's and the base's outputs
    (the KL reference) without PEFT's `disable_adapter`, which walks every module twice and
    costs a small model as much as the forward. Use it only where `rows_maskable(model)`:
    a layer left unfused cannot see the scales, and a fused one in a state it does not
    cover (merged, disabled...) raises rather than add its term to every row."""
    layers = [m for m in model.modules() if _is_fused(m)]
    for layer in layers:
        setattr(layer, ROW_SCALE, scale)
    try:
        yield
    finally:
        for layer in layers:
            setattr(layer, ROW_SCALE, None)


def _is_fused(module: Any) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, partial) and forward.func is _fused_forward


def rows_maskable(model: Any) -> bool:
    """Whether `lora_on_rows` reaches every LoRA layer of `model` as it is now: each one a
    fused linear layer (`fuse_lora_adds`) that takes the fused path."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        if not _is_fused(module) or not _fusable(module):
            return False
    return True


def _fusable(layer: Any) -> bool:
    active = layer.active_adapters
    return not (layer.disable_adapters or layer.merged or len(active) != 1
                or active[0] not in layer.lora_A or active[0] in layer.lora_variant
                or layer.lora_B[active[0]].bias is not None)


def _fused_forward(layer: Any, peft_forward: Any, x: torch.Tensor, *args: Any,
                   **kwargs: Any) -> torch.Tensor:
    rows = getattr(layer, ROW_SCALE, None)
    if args or kwargs or not _fusable(layer):
        if rows is not None:
            raise RuntimeError("lora_on_rows reached a LoRA layer it does not cover; "
                               "check rows_maskable(model) first")
        return peft_forward(x, *args, **kwargs)  # type: ignore[no-any-return]
    name = layer.active_adapters[0]
    a, b = layer.lora_A[name].weight, layer.lora_B[name].weight
    result = layer.base_layer(x)
    if result.dtype in LOW_PRECISION and a.dtype not in LOW_PRECISION:
        a, b = a.to(result.dtype), b.to(result.dtype)  # the term in the base's precision
    low = torch.nn.functional.linear(layer.lora_dropout[name](x.to(a.dtype)), a)
    if rows is not None:
        if low.dim() < 2 or low.shape[0] != rows.shape[0]:
            raise RuntimeError(f"lora_on_rows: {rows.shape[0]} row scales for a LoRA input "
                               f"of shape {tuple(x.shape)}")
        low = low * rows.to(low.device, low.dtype).view(-1, *[1] * (low.dim() - 1))
    total = torch.addmm(
        result.reshape(-1, result.shape[-1]).to(low.dtype),
        low.reshape(-1, low.shape[-1]),
        b.t(),
        alpha=layer.scaling[name],
    )
    return total.view(result.shape).to(result.dtype)
