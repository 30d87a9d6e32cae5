"""Keep a service's start-up objects out of Python's full garbage collections.

A full (generation 2) collection walks every container object the process holds. Most of
a service's are its imports and what it loaded at start (torch, transformers and their
modules, functions and dicts: hundreds of thousands of objects in the learner and in a
workflow worker once it has imported its tokenizer classes), alive until the process
exits, and a walk over them is a pause long enough to show in a step on the demo's 2
cores, during which the process does nothing else (`marl demo --trace` records every
process's collections). CPython starts one whenever the objects that survived younger collections
reach a quarter of the ones the last full collection kept, which steps of a training run
reach every so often. Two workers that take a step's tasks alike reach it in the same
step, so that step's episodes all start late by that pause.

`freeze_long_lived` collects once, then moves every object alive into the permanent
generation (`gc.freeze`), which no collection walks: later full collections walk only
what was created since. Called where a service has loaded what it keeps and has nothing
in flight, so that what it freezes is what lives as long as the process; an object
frozen there is still freed when its last reference goes, and only a reference cycle
created before the freeze and dropped after it would never be collected.
"""

from __future__ import annotations

import gc


def freeze_long_lived() -> int:
    """Collect, then leave every object alive now out of later collections. Returns how
    many objects are frozen (all freezes so far): a later call collects and freezes only
    what came after the last."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
