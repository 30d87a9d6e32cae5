"""Four runs at once against one after another, on one cluster.

One cluster of the demo model (one inference replica, one workflow worker, one learner
with `learner.max_concurrent_runs` 4, or `--learners N` learner processes taking 4/N
runs each from the one queue; the cores split between inference and learner as
for runs that generate and train at once, `--split`) trains four demo cells, Voting SP,
Voting IP, Single and Orch-Workers SP, `--steps` steps each: first one after another (each
submitted when the last ended), then all four submitted at once; with `--rounds` each
round starts with the other way, and the figures are means over the rounds. For each way: the
wall-clock time from the first submission to the last run's end, the training steps per
second over it, and the CPU seconds each kind of service spent (cores busy: their sum over
the wall time). One at a time, inference and the workers idle while a run updates and the
learner idles while it generates; at once, one run's update fills another's generation.
Then the ratio, at once / one after another, and how far each run's per-step losses are
from those of the cell's first run (they train the same: 0). A short warm-up run goes
first, unmeasured. The last line is one JSON object.

    python bench/concurrent_runs.py [--steps 6] [--problems 8] [--group 4] [--rounds 1]
        [--split overlapped|sync] [--policy-process server|own] [--learners 1]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from cpu_use import cpu_seconds
from host import describe, host
from snapshot import add_save_option, emit

from marl.clients.runs import RunsClient
from marl.local.launcher import DEFAULT_CORES, Cluster, service_threads
from marl.models.demo import demo_model_dir

CELLS = (("voting", "shared"), ("voting", "isolated"), ("single", "shared"),
         ("orch_workers", "shared"))  # fmt: skip


def cell_spec(workflow: str, policy: str, out: Path, args: argparse.Namespace,
              steps: int) -> dict[str, Any]:  # fmt: skip
    return {
        "name": f"{workflow}-{policy}",
        "workflow": workflow,
        "policy": policy,
        "seed": 0,
        "out_dir": str(out),
        "model": {"path": str(demo_model_dir())},
        "lora": {"rank": 8, "alpha": 16},
        "optim": {"lr": 2e-3, "warmup_steps": 0},
        "grpo": {"group_size": args.group},
        "train": {
            "steps": steps,
            "problems_per_step": args.problems,
            "val_interval": 100_000,
            "val_problems": 1,
            "checkpoint_interval": 100_000,
        },
        "sampling": {"temperature": 1.0, "max_tokens": args.max_tokens},
        "data": {"train": "arithmetic", "val": "arithmetic"},
        "learner": {"policy_process": args.policy_process},
    }


def losses(out: Path) -> list[dict[str, float]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k.endswith("/loss")} for r in rows if r["step"] >= 1]


def train(runs: RunsClient, specs: list[dict[str, Any]], at_once: bool,
          pids: dict[str, list[int]]) -> dict[str, Any]:  # fmt: skip
    """Train `specs` at once or one after another: the wall time, each run's end, and the
    CPU seconds each kind of service spent meanwhile."""
    cpu0 = {kind: cpu_seconds(p) for kind, p in pids.items()}
    started = time.monotonic()
    ended: dict[str, float] = {}
    if at_once:
        ids = {runs.submit(s): s["name"] for s in specs}
    else:
        ids = {}
        for s in specs:
            run_id = runs.submit(s)
            ids[run_id] = s["name"]
            info = runs.wait(run_id, poll_s=0.2)
            assert info.state == "SUCCEEDED", (s["name"], info.error)
            ended[s["name"]] = time.monotonic() - started
    while len(ended) < len(ids):
        for run_id, name in ids.items():
            if name not in ended and (info := runs.get(run_id)).done:
                assert info.state == "SUCCEEDED", (name, info.error)
                ended[name] = time.monotonic() - started
        time.sleep(0.2)
    wall = time.monotonic() - started
    cpu = {kind: cpu_seconds(p) - cpu0[kind] for kind, p in pids.items()}
    steps = sum(s["train"]["steps"] for s in specs)
    return {"wall_s": wall, "steps": steps, "steps_per_s": steps / wall, "ended_s": ended,
            "cpu_s": cpu, "cores_busy": sum(cpu.values()) / wall}


WAYS = (("one after another", False), ("at once", True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="training steps of each cell")
    ap.add_argument("--problems", type=int, default=8, help="problems per step")
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1,
                    help="times through both ways, in turn first (drift on a shared host)")
    ap.add_argument("--cores", type=int, default=DEFAULT_CORES)
    ap.add_argument("--split", choices=["overlapped", "sync"], default="overlapped",
                    help="the cores' split between inference and learner "
                    "(marl.local.launcher.service_threads): disjoint shares, as for runs "
                    "that generate and train at once (what `marl matrix --parallel` starts), "
                    "or a synchronous run's (the learner on every core)")
    ap.add_argument("--policy-process", choices=["server", "own"], default="server",
                    help="each run's learner.policy_process: in the learner's process, "
                    "the runs' torch work takes turns on its one torch thread; `own`, each "
                    "run's policy in a process of its own")
    ap.add_argument("--warm-policy-processes", type=int, default=None,
                    help="the learner's learner.warm_policy_processes (default: one per "
                    "cell with --policy-process own, else 0)")
    ap.add_argument("--learners", type=int, default=1,
                    help="learner processes taking runs from the one queue, each training "
                    "up to 4/learners runs at once on a torch thread of its own")
    add_save_option(ap)
    args = ap.parse_args()
    facts = host()
    print(describe(facts), flush=True)
    threads = service_threads(args.cores, overlapped=args.split == "overlapped")
    if args.warm_policy_processes is None:
        args.warm_policy_processes = len(CELLS) if args.policy_process == "own" else 0
    # the learner reads its settings from the environment (marl.spec.services.from_env)
    os.environ["MARL_LEARNER_WARM_POLICY_PROCESSES"] = str(args.warm_policy_processes)
    results: dict[str, list[dict[str, Any]]] = {way: [] for way, _ in WAYS}
    diffs: list[float] = []
    with tempfile.TemporaryDirectory(prefix="marl-concurrent-runs-") as tmp:
        root = Path(tmp)
        cluster = Cluster(root / "cluster", str(demo_model_dir()), engine="transformers",
                          sandbox_replicas=0, threads=threads, learner_replicas=args.learners,
                          max_concurrent_runs=-(-len(CELLS) // args.learners))
        started = time.monotonic()
        with cluster, RunsClient(cluster.endpoints()["learner"]) as runs:
            print(f"cluster up in {time.monotonic() - started:.0f}s", flush=True)
            warm = cell_spec("voting", "shared", root / "warm-up", args, 1)
            assert runs.wait(runs.submit(warm), poll_s=0.2).state == "SUCCEEDED"
            for n in range(args.rounds):
                for way, at_once in WAYS if n % 2 == 0 else WAYS[::-1]:
                    specs = [cell_spec(w, p, root / f"{w}-{p}-{at_once}-{n}", args, args.steps)
                             for w, p in CELLS]  # fmt: skip
                    r = train(runs, specs, at_once, cluster.pids_by_kind())
                    results[way].append(r)
                    print(f"{way:<18} {r['steps']} steps in {r['wall_s']:6.1f} s: "
                          f"{r['steps_per_s']:.3f} steps/s  (runs ended at "
                          + ", ".join(f"{c} {s:.0f}s" for c, s in r["ended_s"].items()) + ")",
                          flush=True)
            for w, p in CELLS:  # each run against the cell's first one after another
                first = losses(root / f"{w}-{p}-False-0")
                for n, at_once in itertools.product(range(args.rounds), (False, True)):
                    other = losses(root / f"{w}-{p}-{at_once}-{n}")
                    diffs += [abs(a[k] - b[k]) for a, b in zip(first, other, strict=True)
                              for k in a]  # fmt: skip
    mean = {way: {"steps_per_s": statistics.mean(r["steps_per_s"] for r in rs),
                  "wall_s": statistics.mean(r["wall_s"] for r in rs),
                  "cores_busy": statistics.mean(r["cores_busy"] for r in rs),
                  "cpu_s": {k: statistics.mean(r["cpu_s"][k] for r in rs) for k in rs[0]["cpu_s"]}}
            for way, rs in results.items()}  # fmt: skip
    seq, conc = mean["one after another"], mean["at once"]
    ratio = conc["steps_per_s"] / seq["steps_per_s"]
    print(f"\nconcurrent_runs bench: {len(CELLS)} demo cells "
          f"({', '.join(f'{w}/{p}' for w, p in CELLS)}), {args.steps} steps of "
          f"{args.problems} problems x {args.group} each, {args.cores} cores, {args.split} "
          f"split, policy_process {args.policy_process} "
          f"({args.warm_policy_processes} warm), {args.learners} learner(s); means "
          f"over {args.rounds} round(s)")
    kinds = list(seq["cpu_s"])
    print(f"{'way':<18} {'wall s':>8} {'steps/s':>8} {'cores busy':>11}  "
          + "  ".join(f"{k + ' CPU s':>14}" for k in kinds))
    for way, r in mean.items():
        print(f"{way:<18} {r['wall_s']:>8.1f} {r['steps_per_s']:>8.3f} {r['cores_busy']:>11.2f}  "
              + "  ".join(f"{r['cpu_s'][k]:>14.1f}" for k in kinds))
    print(f"at once / one after another: {ratio:.2f}x (goal >= 1.5x on 2 cores)")
    print(f"largest per-step loss difference from the cell's first run: {max(diffs):.3g}")
    emit({
        "bench": "concurrent_runs", "cells": [f"{w}/{p}" for w, p in CELLS],
        "steps": args.steps, "problems": args.problems, "group": args.group,
        "rounds": args.rounds, "cores": args.cores, "split": args.split,
        "policy_process": args.policy_process, "learners": args.learners,
        "warm_policy_processes": args.warm_policy_processes,
        "sequential_steps_per_s": round(seq["steps_per_s"], 4),
        "concurrent_steps_per_s": round(conc["steps_per_s"], 4),
        "ratio": round(ratio, 3), "max_loss_diff": max(diffs),
        "cores_busy": {way: round(r["cores_busy"], 2) for way, r in mean.items()},
        "host": facts,
    }, args.save)  # fmt: skip


if __name__ == "__main__":
    main()
