"""`guard.on_alarm: rollback` in a real run: an alarm sends every adapter back to the best
checkpoint and the run trains on at half the learning rate, said in metrics.jsonl and by
the CLI; past `guard.max_rollbacks` the next such alarm stops the run.

The alarm is made certain to fire: entropy_collapse at a 0.1 % fall of one step's entropy
(window 1), which the demo model's first steps of RL always reach.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from marl.local.demo import DEMO_SPEC


@pytest.mark.slow


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_rollback_guard_in_a_demo_run(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "marl.cli", "demo", "--out", str(out), "--steps", "6",
         "guard.on_alarm.entropy_collapse=rollback", "alarms.window=1", "alarms.min_points=2",
         "alarms.entropy_drop=0.001", "train.val_interval=2", "train.val_problems=20"],
        capture_output=True, text=True, timeout=550,
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    guards = {r["step"]: r["guard"] for r in rows if r.get("guard")}
    rollbacks = [s for s, g in guards.items() if g.startswith("rollback: entropy_collapse")]
    assert rollbacks, proc.stdout[-3000:]
    assert "GUARD rollback: entropy_collapse" in proc.stdout

    lr = DEMO_SPEC["optim"]["lr"]
    for n, at in enumerate(rollbacks, start=1):
        assert guards[at].endswith(f"learning rate x{0.5**n:g} (rollback {n} of 2)")
        after = [r for r in rows if r["step"] == at + 1]
        if after:  # the next step trains at the lowered rate
            assert after[0]["train/lr"] == pytest.approx(lr * 0.5**n)
        back_to = int(guards[at].split("adapters back to step ")[1].split()[0])
        assert 1 <= back_to <= at  # the best checkpoint so far
    if proc.returncode == 0:
        assert len(rollbacks) <= 2
    else:  # a third alarm after two rollbacks stopped the run, naming the limit
        assert len(rollbacks) == 2, proc.stdout[-3000:]
        assert "after guard.max_rollbacks=2 rollbacks" in proc.stdout
        assert max(guards) > rollbacks[-1] and guards[max(guards)].startswith("stop: ")
