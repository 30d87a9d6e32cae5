"""Hand freed heap pages back to the operating system.

glibc keeps memory that Python and torch free inside its arenas (one per thread that
allocated it) and reuses it only for later requests that fit. A long-running service
that allocates differently sized batches from a pool of threads therefore shows a
resident size that drifts up with the largest batches and the number of threads that
ever touched them, though nothing is alive. `malloc_trim(0)` releases every arena's
free pages, so resident memory tracks what is actually held.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)  # glibc only, not musl
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim  # type: ignore[no-any-return]


def release_free_heap() -> bool:
    """Return free heap pages to the OS; False where the C library cannot."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
