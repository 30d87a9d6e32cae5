"""The learner's torch threads in an overlapped run that shares its machine's cores.

With `train.max_staleness` >= 1 on one machine, the inference replica generates the
next steps' rollouts while the learner trains, so the two get disjoint shares of the
cores (`marl.local.launcher.service_threads`): OpenMP pools that spin on each other's cores
cost more than they give. But generation usually ends well before the update does
(`bench/e2e.py` traces both), and from then on the inference
share idles. `ThreadBurst` hands it to the
learner: once every rollout of the steps queued ahead has arrived, the learner's next
forward runs with `burst` threads; the next step starts on its `share` again, when its
own newly queued tasks start generating.

The thread count of OpenMP (and so of torch's CPU operators) belongs to the thread that
runs them, so the switch happens where the forwards run, at each forward of the update
(`MultiAdapterPolicy.features` calls `pace`); the event loop only says when. That may be
another process (`learner.policy_process`): the burst's state is shared memory, so the
server's event loop starts steps and reports rollouts without calling into it.
"""

from __future__ import annotations

import multiprocessing as mp
import time

import torch


class ThreadBurst:
    def __init__(self, share: int, burst: int):
        self.share = share
        self.burst = burst
        ctx = mp.get_context("spawn")  # the policy's own process is spawned (ranks.py)
        self._idle = ctx.Event()
        self._step = ctx.RawValue("q", 0)
        """Steps started: `pace` goes back to the share when it sees a new one."""
        self._burst_at = ctx.RawValue("d", 0.0)
        """time.monotonic() of the burst this step (0: none yet); one clock per machine."""
        self._paced_step = 0

    @classmethod
    def of_this_process(cls, burst: int) -> ThreadBurst | None:
        """Its share: the threads this process's torch starts with (OMP_NUM_THREADS); None
        when `burst` is no more than that."""
        share = torch.get_num_threads()
        return cls(share, burst) if burst > share else None

    @property
    def enabled(self) -> bool:
        return self.burst > self.share

    def start_step(self) -> None:
        """Any thread, before a step's update: its forwards go back to the share."""
        self._idle.clear()
        self._burst_at.value = 0.0
        self._step.value += 1

    def rollouts_in(self) -> None:
        """Any thread: every rollout queued ahead has arrived; the cores are the learner's."""
        self._idle.set()

    def pace(self) -> None:
        """The thread that runs the forwards, before each: the share at a step's start,
        the burst once the rollouts are in."""
        step = self._step.value
        if step != self._paced_step:
            self._paced_step = step
            self.keep_share()
        if self._burst_at.value == 0.0 and self._idle.is_set():
            self._burst_at.value = time.monotonic()
            torch.set_num_threads(self.burst)

    def keep_share(self) -> None:
        """The calling thread back to the share (the torch thread, once a run ends)."""
        if torch.get_num_threads() != self.share:
            torch.set_num_threads(self.share)

    def burst_seconds(self) -> float:
        """How long the update has had the burst so far (0 when it never got it)."""
        at = self._burst_at.value
        return 0.0 if at == 0.0 else time.monotonic() - at
