"""What a heap trim costs the GRPO update it lands in, against one between updates.

The learner hands free heap pages back to the OS after every step (`marl.runtime.heap`). One step
ahead (`train.max_staleness` >= 1) the next update is already running when a step's
record is written, and the trim once ran there, on the event loop: it handed back the
pages of the activations the update was freeing and reallocating, and each faulted in
again. Now it runs on the torch thread, between updates (`services.learner.trainer`).

On the demo's Voting batch (`bench/learner.py`'s: 512 role-turn sequences, Shared-Policy),
three ways, alternating, `--repeats` GRPO steps each after a warm-up:
  between: the trim after each step, on the thread that ran it (the learner now);
  mid:     the trim from another thread `--delay` seconds into each step (the learner one
           step ahead before);
  none:    no trim.
Printed: per way, the median step time and minor page faults; the ratio mid / between;
the trim's own time between steps. The last line is one JSON object.

    python bench/heap_trim.py [--threads 1] [--delay 0.3] [--repeats 5]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import threading
import time

import torch
from learner import demo_policy, voting_batch
from snapshot import add_save_option, emit
from transformers import AutoTokenizer

from marl.models.demo import demo_model_dir
from marl.runtime.heap import keep_freed_heap_until_trimmed, release_free_heap
from services.learner.update import grpo_step

WAYS = ("between", "mid", "none")


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads: 1 is the learner's share one step ahead")
    ap.add_argument("--delay", type=float, default=0.3, help="mid: seconds into the step")
    ap.add_argument("--repeats", type=int, default=5)
    add_save_option(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not keep_freed_heap_until_trimmed():
        raise SystemExit("this C library has no malloc_trim/mallopt: nothing to measure")
    rollouts = voting_batch(AutoTokenizer.from_pretrained(str(demo_model_dir())), 16, 8, 0)
    groups = [r.problem_id for r in rollouts]
    spec, roles, policy = demo_policy("shared", 8, 0)
    trim_s: list[float] = []

    def step(way: str) -> tuple[float, int]:
        timer = threading.Timer(args.delay, release_free_heap) if way == "mid" else None
        if timer is not None:
            timer.start()
        faults, t0 = minor_faults(), time.perf_counter()
        grpo_step(policy, rollouts, groups, roles, spec)
        seconds, faults = time.perf_counter() - t0, minor_faults() - faults
        if timer is not None:
            timer.join()
        if way == "between":
            t0 = time.perf_counter()
            release_free_heap()
            trim_s.append(time.perf_counter() - t0)
        return seconds, faults

    for way in WAYS:  # warm-up
        step(way)
    runs: dict[str, list[tuple[float, int]]] = {way: [] for way in WAYS}
    for _ in range(args.repeats):
        for way in WAYS:
            runs[way].append(step(way))
    figures: dict[str, float] = {}
    print(f"demo Voting batch, {len(rollouts)} rollouts; {args.threads} torch threads; "
          f"mid: the trim {args.delay} s into the step; median of {args.repeats} steps")
    print(f"{'trim':<8} {'step s':>8} {'faults':>8}")
    for way in WAYS:
        seconds = statistics.median(s for s, _ in runs[way])
        faults = int(statistics.median(f for _, f in runs[way]))
        print(f"{way:<8} {seconds:>8.3f} {faults:>8}")
        figures[f"{way}_step_s"] = round(seconds, 4)
        figures[f"{way}_faults"] = faults
    ratio = figures["mid_step_s"] / figures["between_step_s"]
    trim_ms = 1000 * statistics.median(trim_s)
    print(f"mid / between step time: {ratio:.3f}; the trim between steps: {trim_ms:.1f} ms")
    emit({"bench": "heap_trim", "threads": args.threads,
                      "mid_over_between": round(ratio, 4), "trim_ms": round(trim_ms, 2),
                      **figures}, args.save)


if __name__ == "__main__":
    main()
