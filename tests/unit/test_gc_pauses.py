"""marl.runtime.gc_pauses: what a service holds at start is left out of later collections."""

from __future__ import annotations

import gc
import weakref

from marl.runtime.gc_pauses import freeze_long_lived


class Node:
    """An object in a reference cycle with itself: only the collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_a_cycle_alive_at_the_freeze_outlives_collections_and_a_later_one_does_not() -> None:
    before = Node()
    frozen_ref = weakref.ref(before)
    try:
        frozen = freeze_long_lived()
        assert frozen == gc.get_freeze_count() > 0
        after = Node()
        later_ref = weakref.ref(after)
        del before, after
        gc.collect()
        assert later_ref() is None
        assert frozen_ref() is not None
    finally:
        gc.unfreeze()
    gc.collect()
    assert frozen_ref() is None


def test_garbage_alive_before_the_freeze_is_collected_first() -> None:
    garbage = Node()
    ref = weakref.ref(garbage)
    del garbage
    try:
        freeze_long_lived()
        assert ref() is None
    finally:
        gc.unfreeze()
