"""A run's turn on the learner process's torch thread, with random generators of its own.

The runs one learner trains at once (`learner.max_concurrent_runs`) share the process's
`TorchThread` (marl/runtime/torch_thread.py: one OpenMP team per process), whose queue
serves their calls first come, first served: each run's update, push snapshot and
checkpoint in turn. torch's and Python's default generators are the process's, though,
so runs that share it would draw from one another's streams: a run's LoRA dropout after
another run seeded its LoRA init (`torch.manual_seed` in `MultiAdapterPolicy`) or restored
its checkpoint's RNG state (`checkpoint.read_shards`) would draw other numbers than
the same run trained alone. A `RunLane` puts the run's own generator states (torch's CPU
generator, CUDA's once initialised, `random`'s) in place before each of its calls and
keeps what the call left after, so each run draws what it would draw alone.

A policy in processes of its own (`learner.policy_process`, `learner.world_size` > 1) has
its generators there; the lane then swaps only the server's, which none of its calls use.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any, TypeVar

from marl.runtime.torch_thread import TorchThread

R = TypeVar("R")


def _get_rng() -> tuple[Any, ...]:
    import torch

    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda, random.getstate()


def _set_rng(state: tuple[Any, ...]) -> None:
    import torch

    cpu, cuda, py = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(py)


class RunLane(TorchThread):
    """A run's view of the shared `TorchThread`: the same thread, the run's generators."""

    def __init__(self, thread: TorchThread):  # no pool of its own: the thread's
        self.thread = thread
        self._rng: tuple[Any, ...] | None = None
        """The run's generator states after its last call (None before its first: the
        first call takes the process's, as a run alone in the process does)."""

    def _in_lane(self, fn: Callable[..., R], args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
        if self._rng is not None:
            _set_rng(self._rng)
        try:
            return fn(*args, **kwargs)
        finally:
            self._rng = _get_rng()

    def run(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> asyncio.Future[R]:
        return self.thread.run(self._in_lane, fn, args, kwargs)

    def call(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        return self.thread.call(self._in_lane, fn, args, kwargs)

    def close(self) -> None:
        """Nothing: the thread is the process's, and outlives the run."""
