"""One copy of a frozen base model per learner process, shared by the runs it trains.

A learner process trains up to `learner.max_concurrent_runs` runs at once, and each
run's `MultiAdapterPolicy` wraps the base model in LoRA layers of its own. PEFT
wraps a model in place (it swaps each target `nn.Linear` for a LoRA layer holding
it), so runs cannot share one module tree; they share its tensors instead. The base
is loaded once per (model path, dtype, device) and kept as a pristine template; each
run gets `checkout`'s copy of the template's modules whose parameters are the
template's own `nn.Parameter` objects. The runs' adapters, optimizers and random
generators stay theirs (policy.py, run_lane.py).

Sharing is safe because nothing writes the base: its parameters have requires_grad
False (no gradient, no optimizer holds them), LoRA is never merged into them, and
adapter loads touch adapter keys only. Buffers (rotary frequencies and the like) are
small and copied per run, so a module that rewrites a buffer rewrites its own.

The template lives as long as a run's model holds it: `_loaded` maps each key to it
weakly, so the copy in memory goes when the last policy using it is gone.

A policy sharded over a group of processes (FSDP, world size above 1) does not use
this: `fully_shard` replaces each layer's parameters with that run's own shard.
"""

from __future__ import annotations

import copy
import threading
import weakref
from pathlib import Path
from typing import Any

import torch

from marl.models.causal_lm import load_causal_lm


class SharedBase:
    """A loaded base model (the template, never wrapped) and the key it was loaded for."""

    def __init__(self, key: tuple[str, str, str], model: torch.nn.Module):
        self.key = key
        self.model = model

    def checkout(self) -> torch.nn.Module:
        """A module tree of the base of its own, holding the template's parameters (the
        same tensors: tied weights stay tied) and copies of its buffers."""
        memo: dict[int, Any] = {id(p): p for p in self.model.parameters()}
        copied = copy.deepcopy(self.model, memo)
        copied.requires_grad_(False)
        return copied


_loaded: weakref.WeakValueDictionary[tuple[str, str, str], SharedBase] = (
    weakref.WeakValueDictionary()
)
_lock = threading.Lock()


def key_of(model_path: str, dtype: torch.dtype, device: torch.device) -> tuple[str, str, str]:
    return str(Path(model_path).resolve()), str(dtype), str(device)


def acquire(model_path: str, dtype: torch.dtype, device: torch.device) -> SharedBase:
    """The process's base model for this key, loaded (and moved to `device`) on first use.
    Hold the returned object as long as a model checked out of it is in use."""
    key = key_of(model_path, dtype, device)
    with _lock:
        shared = _loaded.get(key)
        if shared is None:
            model: torch.nn.Module = load_causal_lm(model_path, dtype)
            model.requires_grad_(False)
            model.to(device)
            shared = SharedBase(key, model)
            _loaded[key] = shared
        return shared


def loaded() -> list[tuple[str, str, str]]:
    """The keys of the base models this process holds now."""
    return list(_loaded.keys())
