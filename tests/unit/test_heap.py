"""release_free_heap hands free pages inside glibc's heap back to the OS."""

from __future__ import annotations

import ctypes.util

import pytest

from marl.heap import release_free_heap


def rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(ctypes.util.find_library("c") is None, reason="no C library found")
def test_freed_but_fragmented_heap_is_returned() -> None:
    blocks = [bytearray(4000) for _ in range(50_000)]  # ~200 MB of small heap blocks
    survivors = blocks[::64]  # one live block in every 64 pins the heap's top in place
    del blocks
    before = rss_kb()
    assert release_free_heap()
    after = rss_kb()
    assert before - after > 100 * 1024, (before, after)
    assert len(survivors) == 782
