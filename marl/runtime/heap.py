"""Hand freed heap pages back to the operating system.

glibc keeps memory that Python and torch free inside its arenas (one per thread that
allocated it) and reuses it only for later requests that fit. A long-running service
that allocates differently sized batches from a pool of threads therefore shows a
resident size that drifts up with the largest batches and the number of threads that
ever touched them, though nothing is alive. `malloc_trim(0)` releases every arena's
free pages, so resident memory tracks what is actually held.

Between those trims, glibc's defaults hand memory back on their own: a block over the
mmap threshold is mapped and unmapped per allocation, and a heap whose free top passes
the trim threshold shrinks. A torch step frees and reallocates activations of a few MB
thousands of times, and every page of each fresh mapping faults on first touch (a step
of the demo's Voting update takes a great many such faults, each dear on a VM;
`bench/heap_trim.py` counts them). `keep_freed_heap_until_trimmed` makes glibc keep what a step frees
for the step's own next allocations (in the learner only blocks under 1 MiB, for its
peak's sake: LEARNER_MMAP_THRESHOLD); the services' explicit `release_free_heap` still
returns it: the inference replica's after a batch, the learner's when a run ends and, while
other runs share the learner, after each step (a run alone reuses the pages next step). A trim
belongs on the thread that runs the torch work, between steps: in the middle of one it
hands back the pages the step is freeing and reallocating, and they fault in again.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from collections.abc import Callable
from typing import Any

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
HEAP_TOP_PAD = 64 << 20
"""Address space the heap grows by at a time (pages are resident only once touched)."""
MMAP_THRESHOLD = 32 << 20
"""Blocks under this come from the heap (glibc's largest setting on 64-bit), activations of
a few MB among them: the inference replica's setting."""
LEARNER_MMAP_THRESHOLD = 1 << 20
"""The learner's: blocks of 1 MiB and more are mapped on their own. Its steps on real
models hold the heap's free holes at the peak, so against the replica's threshold a step
peaks far lower for a little more step time (`bench/mmap_threshold.py` measures both; docs/benchmarks.md).
A learner bound by time rather than memory can take 32 MiB with
`MALLOC_MMAP_THRESHOLD_=33554432`."""
TRIM_THRESHOLD = 256 << 20
"""Free heap top glibc keeps before it trims on its own; the trim between steps returns
the rest."""


@functools.cache
def _mallopt() -> Callable[[int, int], int] | None:
    return _libc_function("mallopt", [ctypes.c_int, ctypes.c_int])


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    return _libc_function("malloc_trim", [ctypes.c_size_t])


@functools.cache
def _libc() -> ctypes.CDLL | None:
    library = ctypes.util.find_library("c")  # runs ldconfig: once per process
    return None if library is None else ctypes.CDLL(library)


def _libc_function(name: str, argtypes: list[Any]) -> Callable[..., int] | None:
    """A glibc function; None where the C library lacks it (musl has no malloc_trim)."""
    function = getattr(_libc(), name, None)
    if function is None:
        return None
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function  # type: ignore[no-any-return]


def release_free_heap() -> bool:
    """Return free heap pages to the OS; False where the C library cannot."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def keep_freed_heap_until_trimmed(mmap_threshold: int = MMAP_THRESHOLD) -> bool:
    """Freed blocks stay in the heap for reuse until `release_free_heap`; False where the
    C library has no such settings. For a process that trims at its own quiet points.
    `mmap_threshold`: blocks of at least this many bytes are mapped on their own (the
    inference replica keeps the default, the learner passes LEARNER_MMAP_THRESHOLD). A
    setting the user gave glibc through its own environment variable is left as glibc read
    it (`MALLOC_MMAP_THRESHOLD_=33554432` gives the learner the replica's threshold)."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    return all(
        mallopt(option, value) == 1
        for option, variable, value in (
            (_M_MMAP_THRESHOLD, "MALLOC_MMAP_THRESHOLD_", mmap_threshold),
            (_M_TOP_PAD, "MALLOC_TOP_PAD_", HEAP_TOP_PAD),
            (_M_TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_", TRIM_THRESHOLD),
        )
        if variable not in os.environ
    )
