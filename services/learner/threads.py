"""The learner's torch threads in an overlapped run that shares its machine's cores.

With `train.max_staleness` >= 1 on one machine, the inference replica generates the
next steps' rollouts while the learner trains, so the two get disjoint shares of the
cores (`marl.launcher.service_threads`): OpenMP pools that spin on each other's cores
cost more than they give. But generation usually ends well before the update does
(demo model, 2 cores, K = 1: the next step's rollouts are in after ~40 % of Voting's
update and ~63 % of Single's), and from then on the inference share idles. `ThreadBurst` hands it to the
learner: once every rollout of the steps queued ahead has arrived, the learner's next
forward runs with `burst` threads; the next step starts on its `share` again, when its
own newly queued tasks start generating.

The thread count of OpenMP (and so of torch's CPU operators) belongs to the thread that
runs them, so the switch happens on the torch thread itself, at the forwards of the
update (`MultiAdapterPolicy.features` calls `pace`); the event loop only says when.
"""

from __future__ import annotations

import threading
import time

import torch


class ThreadBurst:
    def __init__(self, share: int, burst: int):
        self.share = share
        self.burst = burst
        self._idle = threading.Event()
        self._burst_at: float | None = None

    @classmethod
    def of_this_process(cls, burst: int) -> ThreadBurst:
        """Its share: the threads this process's torch starts with (OMP_NUM_THREADS)."""
        return cls(torch.get_num_threads(), burst)

    @property
    def enabled(self) -> bool:
        return self.burst > self.share

    def start_step(self) -> None:
        """Torch thread, before a step's update: back to the share."""
        self._idle.clear()
        self._burst_at = None
        if torch.get_num_threads() != self.share:
            torch.set_num_threads(self.share)

    def rollouts_in(self) -> None:
        """Any thread: every rollout queued ahead has arrived; the cores are the learner's."""
        self._idle.set()

    def pace(self) -> None:
        """Torch thread, before a forward: take the burst once the rollouts are in."""
        if self._burst_at is None and self._idle.is_set():
            self._burst_at = time.monotonic()
            torch.set_num_threads(self.burst)

    def burst_seconds(self) -> float:
        """How long the update has had the burst so far (0 when it never got it)."""
        return 0.0 if self._burst_at is None else time.monotonic() - self._burst_at
