"""FSDP2 over the learner's processes: which modules are sharded, and the few collectives
the GRPO step needs besides FSDP's own.

Each decoder layer is one `fully_shard` unit: its frozen base weights and every
adapter's LoRA weights are split across the ranks and gathered for that layer's
forward and backward only. The embeddings, final norm and LM head stay whole on
every rank: they are frozen (no gradient to reduce) and with tied embeddings the
head and the embedding table are one tensor, which two shard groups cannot share.
Gradients are summed across ranks, not averaged: each rank's loss already carries
the step's global token weights, so the sum is the one-process gradient.

With one process (no initialised group of more than one) every function here is
the identity, so single-process code pays nothing for it.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

T = TypeVar("T")


def rank_and_size() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The causal LM's repeated blocks (`model.layers` in Llama, Qwen, Mistral, SmolLM)."""
    base: Any = model
    if hasattr(base, "get_base_model"):
        base = base.get_base_model()
    layers = getattr(base.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(base).__name__} has no decoder `layers` to shard; "
            "learner.world_size above 1 needs a Llama-style causal LM"
        )
    return list(layers)


def shard(model: torch.nn.Module) -> None:
    for layer in decoder_layers(model):
        fully_shard(layer)
        unit: Any = layer
        assert isinstance(unit, FSDPModule)
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a shard (collective), or `t` itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def like(reference: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """`whole` placed as `reference` is: this rank's shard of it when `reference` is one."""
    if not isinstance(reference, DTensor):
        return whole
    local = whole.to(reference.device_mesh.device_type).to(reference.dtype)
    return distribute_tensor(local, reference.device_mesh, reference.placements)


def gather(local: T) -> list[T]:
    """Every rank's `local`, in rank order (collective; [local] with one process)."""
    rank, size = rank_and_size()
    if size == 1:
        return [local]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, local)
    return out


def merge(items: list[torch.Tensor | None], device: torch.device) -> None:
    """Every rank's filled entries of `items` into every rank's `items` (collective): each
    rank computed some of them (e.g. π_old of its share of the micro-batches)."""
    if rank_and_size()[1] == 1:
        return
    mine = {i: x.cpu() for i, x in enumerate(items) if x is not None}
    for part in gather(mine):
        for i, x in part.items():
            if items[i] is None:
                items[i] = x.to(device)


def share(loads: list[int], rank: int, size: int) -> list[int]:
    """Which of `loads` (item sizes, e.g. a micro-batch's padded tokens) this rank takes:
    largest first, each to the least-loaded rank. Every rank computes the same split."""
    if size == 1:
        return list(range(len(loads)))
    totals = [0] * size
    mine: list[int] = []
    for i in sorted(range(len(loads)), key=lambda i: (-loads[i], i)):
        r = min(range(size), key=lambda r: (totals[r], r))
        totals[r] += loads[i]
        if r == rank:
            mine.append(i)
    return sorted(mine)
