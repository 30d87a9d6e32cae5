"""Where a service's torch work runs: `auto`, `cpu` or `cuda`, resolved on this machine."""

from __future__ import annotations

import torch


def resolve_device(name: str, rank: int = 0, field: str = "learner.device") -> str:
    """`name` for one process: `auto` is CUDA when torch sees a GPU; rank r of a group
    takes GPU r. `field` is the setting named in the error a user sees."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"{field}=cuda but torch sees no GPU (torch.cuda.is_available() is "
                f"False); use {field}=cpu or auto"
            )
        if rank >= torch.cuda.device_count():
            raise ValueError(
                f"learner.world_size asks for GPU {rank}, but this machine has "
                f"{torch.cuda.device_count()}; lower learner.world_size"
            )
        return f"cuda:{rank}"
    return "cpu"
