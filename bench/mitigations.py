"""Do marl's mitigations of the paper's two drift mechanisms help on planted drift?

The planted-drift runs of tests/support/drift.py, their specs reused as
they are, on the shipped demo model with every service a process:
- `sp_capture`: Voting-SP whose planted reward pays the aggregator for the generators'
  long-form idiom (`sp_role_capture` on the aggregator), plain and with each mitigation of
  that mechanism: `grpo.role_balance: equal`, and adaptive policy sharing
  (`guard.on_alarm.sp_role_capture: split`: the aggregator gets its own adapter at the
  alarm);
- `ip_amplification`: Voting-IP with the generator's learning rate raised 20x
  (`gradient_amplification` on the generator), plain and with `grpo.parallel_slots: pool`
  and `scale`.
Per run: whether the mechanism's alarm fired and at which step (as the learner logged it in
metrics.jsonl), the split's step, the final and the peak validation accuracy, and each
role's χ² peak over its first value (`update_chi2`, the χ² that moves on a float32 CPU run;
values under `alarms.amplification_chi2_floor` count as the floor, as the alarms read
them). Then per cell and mitigation over the seeds: how many runs fired, and the final and
peak accuracy against the plain runs of the same seeds (differences, so > 0 means the
mitigation helped). The last line is one JSON object.

    python bench/mitigations.py [--seeds 0,1] [--steps 10] [--cells sp_capture,ip_amplification]
                                [--clusters 2]
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import yaml
from snapshot import add_save_option, emit

from marl.local.launcher import Cluster
from marl.models.demo import demo_model_dir
from marl.protocol.v1 import learner_pb2, learner_pb2_grpc
from tests.support import drift as planted

CELLS: dict[str, dict[str, Any]] = {
    "sp_capture": {
        "run": "planted",
        "alarm": "sp_role_capture",
        "mitigations": {
            "none": {},
            "role_balance=equal": {"grpo": {"role_balance": "equal"}},
            "split": {"guard": {"on_alarm": {"sp_role_capture": "split"}}},
        },
    },
    "ip_amplification": {
        "run": "generator_lr",
        "alarm": "gradient_amplification",
        "mitigations": {
            "none": {},
            "parallel_slots=pool": {"grpo": {"parallel_slots": "pool"}},
            "parallel_slots=scale": {"grpo": {"parallel_slots": "scale"}},
        },
    },
}
CHI2 = "update_chi2"


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def run_spec(cell: str, mitigation: str, seed: int, steps: int, out: Path) -> dict[str, Any]:
    c = CELLS[cell]
    data = planted.spec(out, merge(planted.RUNS[c["run"]], c["mitigations"][mitigation]))
    data["seed"] = seed
    data["name"] = f"{cell}-{mitigation.split('=')[-1]}-{seed}"
    data["train"]["steps"] = steps
    return data


def train(stub: Any, data: dict[str, Any]) -> str:
    text = yaml.safe_dump(data)
    run_id = stub.SubmitRun(learner_pb2.SubmitRunRequest(spec_yaml=text), timeout=60).run_id
    for _ in stub.WatchRun(learner_pb2.WatchRunRequest(run_id=run_id, from_start=True),
                           timeout=3600):
        pass
    run = stub.GetRun(learner_pb2.GetRunRequest(run_id=run_id), timeout=10)
    return "" if run.state == "SUCCEEDED" else f"{run.state}: {run.error}"


def chi2_ratios(records: list[dict[str, Any]], floor: float) -> dict[str, float]:
    """Role -> peak over first of its χ², each value at least `floor`."""
    out = {}
    roles = sorted({k.split("/")[1] for r in records for k in r
                    if k.startswith("role/") and k.endswith("/" + CHI2)})
    for role in roles:
        values = [max(float(r[f"role/{role}/{CHI2}"]), floor) for r in records
                  if r.get(f"role/{role}/{CHI2}") is not None]
        if values:
            out[role] = max(values) / values[0]
    return out


def summarise(cell: str, mitigation: str, seed: int, out: Path, error: str) -> dict[str, Any]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    alarm = CELLS[cell]["alarm"]
    fired = [r["step"] for r in records for a in r.get("alarms") or [] if a.startswith(alarm)]
    split = [r["step"] for r in records if str(r.get("guard", "")).startswith("split")]
    val = [float(r["val/accuracy"]) for r in records if "val/accuracy" in r]
    floor = planted.RUNS[CELLS[cell]["run"]].get("alarms", {}).get(
        "amplification_chi2_floor", 0.02
    )
    return {
        "cell": cell,
        "mitigation": mitigation,
        "seed": seed,
        "alarm": alarm,
        "alarm_step": fired[0] if fired else None,
        "split_step": split[0] if split else None,
        "val_first": val[0] if val else None,
        "val_final": val[-1] if val else None,
        "val_peak": max(val) if val else None,
        "chi2_ratio": chi2_ratios(records, floor),
        "error": error,
    }


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'cell':<17} {'mitigation':<21} {'seed':>4} {'alarm@':>6} {'split@':>6} "
            f"{'val0':>5} {'final':>5} {'peak':>5}  {CHI2} peak/first per role")
    lines = [head, "-" * len(head)]
    for r in rows:
        ratios = ", ".join(f"{k} {v:.1f}x" for k, v in r["chi2_ratio"].items())
        lines.append(
            f"{r['cell']:<17} {r['mitigation']:<21} {r['seed']:>4} "
            f"{fmt(r['alarm_step'], 'd'):>6} {fmt(r['split_step'], 'd'):>6} "
            f"{fmt(r['val_first']):>5} {fmt(r['val_final']):>5} {fmt(r['val_peak']):>5}  "
            f"{ratios}{'  ' + r['error'] if r['error'] else ''}"
        )
    return "\n".join(lines)


def compare(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per cell and mitigation over the seeds: runs that fired, and the accuracy
    differences against the plain run of the same seed."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    plain = {(r["cell"], r["seed"]): r for r in rows if r["mitigation"] == "none"}
    for cell, c in CELLS.items():
        for mitigation in c["mitigations"]:
            mine = [r for r in rows if r["cell"] == cell and r["mitigation"] == mitigation]
            if not mine:
                continue
            entry: dict[str, Any] = {
                "runs": len(mine),
                "fired": sum(r["alarm_step"] is not None for r in mine),
                "val_final_mean": statistics.mean(r["val_final"] or 0.0 for r in mine),
                "val_peak_mean": statistics.mean(r["val_peak"] or 0.0 for r in mine),
            }
            if mitigation != "none":
                for key in ("val_final", "val_peak"):
                    diffs = [(r[key] or 0.0) - (plain[(cell, r["seed"])][key] or 0.0)
                             for r in mine if (cell, r["seed"]) in plain]
                    entry[f"{key}_vs_none"] = statistics.mean(diffs) if diffs else None
            out.setdefault(cell, {})[mitigation] = entry
    return out


def serve_jobs(base: Path, index: int, jobs: queue.Queue[tuple[int, str, str]],
               rows: list[dict[str, Any]], steps: int) -> None:
    """One cluster of its own (every service a process) trains runs from JOBS until none is
    left: the learner takes one run at a time, so clusters side by side use both cores."""
    cluster = Cluster(base / f"cluster-{index}", str(demo_model_dir()), engine="transformers",
                      sandbox_replicas=0)
    with cluster:
        stub = learner_pb2_grpc.LearnerStub(grpc.insecure_channel(cluster.endpoints()["learner"]))
        while True:
            try:
                seed, cell, mitigation = jobs.get_nowait()
            except queue.Empty:
                return
            out = base / f"{cell}-{mitigation}-{seed}"
            t0 = time.monotonic()
            error = train(stub, run_spec(cell, mitigation, seed, steps, out))
            row = summarise(cell, mitigation, seed, out, error)
            row["minutes"] = (time.monotonic() - t0) / 60
            rows.append(row)
            print(f"# {cell} {mitigation} seed {seed}: {row['minutes']:.1f} min",
                  file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1", help="comma-separated run seeds")
    ap.add_argument("--steps", type=int, default=planted.STEPS)
    ap.add_argument("--cells", default=",".join(CELLS))
    ap.add_argument("--clusters", type=int, default=2,
                    help="clusters side by side, each training one run at a time")
    add_save_option(ap)
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    cells = args.cells.split(",")
    started = time.monotonic()
    jobs: queue.Queue[tuple[int, str, str]] = queue.Queue()
    for seed in seeds:
        for cell in cells:
            for mitigation in CELLS[cell]["mitigations"]:
                jobs.put((seed, cell, mitigation))
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="marl-mitigations-") as tmp:
        base = Path(tmp)
        workers = [threading.Thread(target=serve_jobs, args=(base, i, jobs, rows, args.steps))
                   for i in range(max(1, args.clusters))]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    if len(rows) != len(seeds) * sum(len(CELLS[c]["mitigations"]) for c in cells):
        raise SystemExit("a cluster failed before its runs finished; see the log above")
    rows.sort(key=lambda r: (r["cell"], list(CELLS[r["cell"]]["mitigations"]).index(
        r["mitigation"]), r["seed"]))
    print(table(rows))
    summary = compare(rows)
    print()
    for cell, per in summary.items():
        for mitigation, e in per.items():
            vs = "" if mitigation == "none" else (
                f", final {fmt(e['val_final_vs_none'], '+.3f')} / peak "
                f"{fmt(e['val_peak_vs_none'], '+.3f')} vs none"
            )
            print(f"{cell:<17} {mitigation:<21} fired {e['fired']}/{e['runs']}, "
                  f"final {e['val_final_mean']:.3f}, peak {e['val_peak_mean']:.3f}{vs}")
    emit({
        "bench": "mitigations",
        "steps": args.steps,
        "seeds": seeds,
        "minutes": round((time.monotonic() - started) / 60, 1),
        "summary": summary,
        "runs": rows,
    }, args.save)


if __name__ == "__main__":
    main()
