"""Follow a run through `Learner.WatchRun`: a progress bar and one line per step."""

from __future__ import annotations

import json
import sys
from typing import Any


def format_step(m: dict[str, Any], total: int) -> str:
    parts = [f"step {m['step']:>4}/{total}"]
    if "train/reward_mean" in m:
        parts.append(f"reward {m['train/reward_mean']:+.3f}")
        parts.append(f"train acc {m['train/accuracy']:.2f}")
    if "val/accuracy" in m:
        parts.append(f"VAL ACC {m['val/accuracy']:.3f}")
    if "time/step_s" in m:
        parts.append(f"{m['time/step_s']:.1f}s/step")
    if m.get("train/episode_errors"):  # scored 0; each logged rollout carries its error
        parts.append(
            f"{m['train/episode_errors']} EPISODES FAILED (rollouts/step_{m['step']:06d}.jsonl)"
        )
    if m.get("val/episode_errors"):
        parts.append(f"{m['val/episode_errors']} VALIDATION EPISODES FAILED")
    if m.get("alarms"):
        parts.append(f"ALARMS {','.join(m['alarms'])}")
    if m.get("guard"):
        parts.append(f"GUARD {m['guard']}")
    return "  ".join(parts)


def follow_run(stub: Any, run_id: str, from_start: bool = True, out: Any = None) -> str:
    """Print every step as it lands, under a `rich` progress bar on a terminal; return the
    run's final state."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from marl.protocol.v1 import learner_pb2

    console = Console(file=out or sys.stdout, highlight=False)
    progress = Progress(
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=not console.is_terminal,
    )
    task = progress.add_task("steps", total=None)
    state = "UNKNOWN"
    with progress:
        req = learner_pb2.WatchRunRequest(run_id=run_id, from_start=from_start)
        for event in stub.WatchRun(req):
            state = event.run.state
            if not event.metrics_json:
                continue
            m = json.loads(event.metrics_json)
            if "step" not in m:
                continue
            total = event.run.total_steps
            progress.update(task, total=total, completed=m["step"])
            console.print(format_step(m, total), markup=False, soft_wrap=True)
    if state == "FAILED":
        console.print(f"run {run_id} FAILED", markup=False)
    return state
