"""vLLM's worker stops spinning soon after its last message on the CPU, not a second later.

vLLM's CPU backend runs the model in a worker process of its own beside the engine
core. The worker reads each step from a shared-memory queue, and after every message
it spins on `sched_yield` for a second (vLLM's `SpinCondition`) before it sleeps on
the queue's socket. A second is longer than a synchronous demo step's update, so on a
machine whose cores the replica shares with the learner, the idle worker took a core
from nearly every update: it burned most of a CPU-second after its last request.

The spin cannot go to zero. A sleeping reader wakes on the ping the writer's socket
sends after each message, and that socket keeps at most one ping queued (a ZeroMQ PUB
socket with a high-water mark of 1) and drops the rest, so a reader that sleeps between
a step's back-to-back messages now and then misses one and waits out vLLM's 5 s
recheck: with no spin, most rounds of a demo-model batch with a busy learner between
them stalled for that recheck. READER_SPIN_S stays awake across a step's messages
(`test_a_vllm_worker_that_sleeps_when_idle_never_waits_out_a_missed_wakeup` fails with
no spin or too short a one) and spends next to nothing of that CPU-second
(docs/benchmarks.md; the runs are in the git history of docs/throughput.md).

vLLM takes the spin time from a default argument and spawns its worker, so the default
has to change in the worker itself: on the CPU the engine names `IdleWorker` as vLLM's
`worker_extension_cls`, and vLLM imports this module in the worker before the worker
builds its queues. Only the worker: the engine core reads the worker's answers with
vLLM's own spin, which runs only while a step computes (asleep at once there too, the
same rounds typically stalled). On GPUs vLLM keeps its own spin everywhere.
Importing this module changes vLLM's queues in the importing process.
"""

from __future__ import annotations

import inspect
from typing import Any

READER_SPIN_S = 0.05
"""Seconds a queue reader keeps spinning after a message (vLLM's own: 1): long enough to
stay awake between a step's messages, short beside a synchronous step's update."""


def sleep_when_idle(shm_broadcast: Any) -> bool:
    """Make `shm_broadcast.SpinCondition` (vLLM's) default to READER_SPIN_S; True once
    it does. A vLLM without it, or whose spin time is not an argument, is left as is."""
    condition = getattr(shm_broadcast, "SpinCondition", None)
    if condition is None:
        return False
    init = condition.__init__
    if getattr(init, "marl_wrapped", False):
        return True
    signature = inspect.signature(init)
    if "busy_loop_s" not in signature.parameters:
        return False

    def init_sleeping(self: Any, *args: Any, **kw: Any) -> None:
        given = signature.bind(self, *args, **kw)
        given.arguments.setdefault("busy_loop_s", READER_SPIN_S)
        init(*given.args, **given.kwargs)

    init_sleeping.marl_wrapped = True  # type: ignore[attr-defined]
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
