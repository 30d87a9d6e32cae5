"""One thread for all of a process's torch work.

PyTorch's CPU wheels parallelise operators with GNU OpenMP (libgomp), and libgomp
gives every OS thread that runs a parallel region a team of worker threads of its
own. Once a process's OpenMP threads outnumber its CPUs, libgomp cuts the spinning of
an idle worker waiting for the next region to its throttled count (at most 1,000 spins),
after which it sleeps on a futex; every small operator then pays a wake-up. Work handed to
`asyncio.to_thread` lands on whichever pool thread is free, so a service that does
torch work there (a GRPO step on one thread, a weight load on another) soon has two
teams on a 2-core machine and runs all of them throttled: the demo model's GRPO step
slowed, once a second thread had ever run torch, to its speed under
`OMP_WAIT_POLICY=PASSIVE` (docs/benchmarks.md). So a service runs its torch work through
one `TorchThread`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


class TorchThread:
    def __init__(self, name: str = "torch"):
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)

    def run(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> asyncio.Future[R]:
        """`fn(*args, **kwargs)` on the thread, to await without blocking the event loop (a
        future, not a coroutine: no frame of its own between the caller and `fn`)."""
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def call(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """`fn(*args, **kwargs)` on the thread, from outside an event loop (blocks)."""
        return self._pool.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
