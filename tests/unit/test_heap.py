"""release_free_heap hands free pages inside glibc's heap back to the OS;
keep_freed_heap_until_trimmed keeps them for reuse until then."""

from __future__ import annotations

import ctypes.util
import json
import os
import subprocess
import sys

import pytest

from marl.runtime.heap import release_free_heap


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


ROUNDS = """
import json, resource, sys
from marl.runtime.heap import keep_freed_heap_until_trimmed, release_free_heap


def rss_kb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


kept = sys.argv[1] in ("keep", "policy") and keep_freed_heap_until_trimmed()  # 32 MiB
if sys.argv[1] == "policy":  # as the learner does: its policy is built after the setting
    from marl.spec.run import RunSpec
    from marl.models.demo import demo_model_dir
    from services.learner.policy import MultiAdapterPolicy

    spec = RunSpec()
    policy = MultiAdapterPolicy(str(demo_model_dir()), ["shared"], spec.lora, spec.optim, 10)
    release_free_heap()  # what building it (and the demo model, on a cold cache) left free


def one_round():  # like a step's activations: ~200 MB live at once, then all freed
    live = [bytearray(2 << 20) for _ in range(100)]  # zero-filled: every page touched
    del live


for _ in range(2):
    one_round()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    one_round()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
before = rss_kb()
release_free_heap()
print(json.dumps({"kept": kept, "faults_per_page": faults / (5 * 100 * 512),
                  "released_kb": before - rss_kb()}))
"""


def heap_rounds(mode: str, env: dict[str, str] | None = None) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, check=True,
        env=None if env is None else {**os.environ, **env},
    )
    return json.loads(out.stdout)  # type: ignore[no-any-return]


@pytest.mark.skipif(ctypes.util.find_library("c") is None, reason="no C library found")
def test_freed_heap_is_kept_for_reuse_until_trimmed() -> None:
    default, kept = heap_rounds("default"), heap_rounds("keep")
    assert kept["kept"]
    # glibc's own thresholds give the freed top back, so each round faults every page in
    assert default["faults_per_page"] > 0.5, default
    assert kept["faults_per_page"] < 0.01, kept
    # what a round frees stays resident until the explicit trim, which still returns it
    assert kept["released_kb"] > 150 * 1024, kept


@pytest.mark.skipif(ctypes.util.find_library("c") is None, reason="no C library found")
def test_the_learners_policy_keeps_the_heap_setting() -> None:
    """The process chooses its heap setting (marl.runtime.heap); a policy once lowered glibc's mmap
    threshold to 1 MiB behind it when it was built."""
    kept = heap_rounds("policy")
    assert kept["kept"]
    assert kept["faults_per_page"] < 0.01, kept


@pytest.mark.skipif(ctypes.util.find_library("c") is None, reason="no C library found")
def test_a_threshold_the_user_gave_glibc_is_kept() -> None:
    kept = heap_rounds("keep", {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)})
    assert kept["kept"]
    assert kept["faults_per_page"] > 0.5, kept  # 2 MiB blocks are mapped and faulted anew
