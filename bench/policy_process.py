"""One step ahead: the learner's policy in the server's process against one of its own.

At `train.max_staleness` 1 the learner server's event loop reads the next step's
rollouts from Redis, queues tasks, pushes adapters and writes the last step's logs while
the update runs on its torch thread. In one process that Python work and the update's
operator dispatch take turns at the interpreter lock; `learner.policy_process: own`
keeps the policy in a process of its own, which the server drives over a pipe
(`services.learner.ranks`).

On the demo model, `bench/e2e.py`'s K = 1 runs (same spec, cores split the same way, a
cluster per run), with `learner.policy_process` `server` and `own` in the order
server own own server, `--rounds` times: per way, steps per wall-clock second over the
steps after the first two of each run, the median `time/update_s` and the learner's CPU
seconds a step (server process and policy process); then own / server. The last line
is one JSON object.

    python bench/policy_process.py [--rounds 1] [--steps 14] [--workflows single,voting]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from e2e import WARMUP_STEPS, run_marl, spec
from snapshot import add_save_option, emit

from marl.local.launcher import DEFAULT_CORES, Cluster, service_threads
from marl.models.demo import demo_model_dir
from marl.monitor.trace_summary import load, step_times, steps_per_s
from marl.runtime.heap import keep_freed_heap_until_trimmed

ORDER = ("server", "own", "own", "server")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=1, help="times through " + " ".join(ORDER))
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--workflows", default="single,voting")
    ap.add_argument("--cores", type=int, default=DEFAULT_CORES)
    add_save_option(ap)
    args = ap.parse_args()
    if args.steps <= WARMUP_STEPS + 1:
        ap.error(f"--steps must leave two steps after the {WARMUP_STEPS} warm-up steps")
    shape = argparse.Namespace(steps=args.steps, problems=16, group=8, max_tokens=16, rank=16)
    workflows = args.workflows.split(",")
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="marl-policy-process-") as tmp:
        root = Path(tmp)
        for n, way in enumerate(ORDER * args.rounds):
            trace_dir = root / f"trace-{n}"
            cluster = Cluster(root / f"cluster-{n}", str(demo_model_dir()),
                              sandbox_replicas=0, workflow_replicas=2, max_lora_rank=16,
                              threads=service_threads(args.cores, overlapped=True),
                              trace_dir=trace_dir)
            with cluster:
                for wf in workflows:
                    out = root / f"{wf}-{n}"
                    body = {**spec(wf, out, shape, 1), "learner": {"policy_process": way}}
                    cpu = run_marl(cluster, body)
                    assert cpu is not None
                    lines = (out / "metrics.jsonl").read_text().splitlines()
                    updates = [r["time/update_s"] for r in map(json.loads, lines)
                               if r["step"] > WARMUP_STEPS]
                    traced = [s for s in step_times(load(trace_dir))
                              if s.run.startswith(f"e2e-{wf}-") and s.step > WARMUP_STEPS]
                    run = {"steps_per_s": steps_per_s(traced),
                           "update_s": statistics.median(updates),
                           "learner_cpu_s": cpu.per_step["learner"]}
                    runs.setdefault((wf, way), []).append(run)
                    print(f"{wf:<8} {way:<7} steps/s {run['steps_per_s']:.3f}  update "
                          f"{run['update_s']:.3f} s  learner CPU {run['learner_cpu_s']:.3f} s "
                          "a step", flush=True)
    figures: dict[str, Any] = {"rounds": args.rounds, "steps": args.steps, "cores": args.cores}
    print(f"\npolicy_process bench: K = 1, {args.cores} cores, steps after the first "
          f"{WARMUP_STEPS} of each run, means over {2 * args.rounds} runs a way")
    for wf in workflows:
        row: dict[str, Any] = {
            way: {k: statistics.mean(r[k] for r in runs[wf, way]) for k in runs[wf, way][0]}
            for way in ("server", "own")
        }
        row["own_vs_server_steps_per_s"] = row["own"]["steps_per_s"] / row["server"]["steps_per_s"]
        row["server_vs_own_update_s"] = row["server"]["update_s"] / row["own"]["update_s"]
        figures[wf] = row
        for way in ("server", "own"):
            f = row[way]
            print(f"{wf:<8} {way:<7} steps/s {f['steps_per_s']:.3f}  update {f['update_s']:.3f} s"
                  f"  learner CPU {f['learner_cpu_s']:.3f} s a step")
        print(f"{wf:<8} own / server steps/s: {row['own_vs_server_steps_per_s']:.2f}x; "
              f"update time server / own: {row['server_vs_own_update_s']:.2f}x")
    emit(figures, args.save)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    keep_freed_heap_until_trimmed()
    main()
