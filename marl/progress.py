"""Follow a run through `Learner.WatchRun`: a progress bar and one line per step."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

BAR_WIDTH = 30


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
        parts.append(f"{m['train/episode_errors']} EPISODES FAILED "
                     f"(rollouts/step_{m['step']:06d}.jsonl)")
    if m.get("val/episode_errors"):
        parts.append(f"{m['val/episode_errors']} VALIDATION EPISODES FAILED")
    if m.get("alarms"):
        parts.append(f"ALARMS {','.join(m['alarms'])}")
    if m.get("guard"):
        parts.append(f"GUARD {m['guard']}")
    return "  ".join(parts)


def bar(step: int, total: int, started: float) -> str:
    frac = step / max(total, 1)
    filled = int(BAR_WIDTH * frac)
    elapsed = time.monotonic() - started
    eta = elapsed / frac - elapsed if frac > 0 else 0.0
    return f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {step}/{total}  {elapsed:.0f}s elapsed, ~{eta:.0f}s left"


def follow_run(stub: Any, run_id: str, from_start: bool = True, out: Any = None) -> str:
    """Print every step as it lands; return the run's final state."""
    from marl.v1 import learner_pb2

    out = out or sys.stdout
    tty = out.isatty()
    started = time.monotonic()
    state = "UNKNOWN"
    for event in stub.WatchRun(learner_pb2.WatchRunRequest(run_id=run_id, from_start=from_start)):
        state = event.run.state
        total = event.run.total_steps
        if event.metrics_json:
            m = json.loads(event.metrics_json)
            if "step" not in m:
                continue
            line = format_step(m, total)
            if tty:
                out.write("\r\033[K" + line + "\n" + bar(m["step"], total, started))
            else:
                out.write(line + "\n")
            out.flush()
    if tty:
        out.write("\n")
    if state == "FAILED":
        out.write(f"run {run_id} FAILED\n")
    return state
