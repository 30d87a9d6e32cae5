"""`marl demo` end to end: every service a process, a real run, and the workflow learns.

The acceptance bar of the demo: validation accuracy of the trained Voting workflow at
least 20 points above the untrained (step 0) value, under both policy routings, and
training reward rising.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("policy", ["shared", "isolated"])
def test_demo_learns(tmp_path: Path, policy: str) -> None:
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "marl.cli", "demo", "--out", str(out), f"policy={policy}"],
        capture_output=True, text=True, timeout=1400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(proc.stdout[-2500:])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    vals = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
    rewards = [r["train/reward_mean"] for r in rows if "train/reward_mean" in r]
    assert rows[0]["step"] == 0 and "val/accuracy" in rows[0]
    assert vals[-1] >= vals[0] + 0.20, f"validation accuracy rose by less than 20 points: {vals}"
    head, tail = rewards[:10], rewards[-10:]
    assert sum(tail) / len(tail) > sum(head) / len(head) + 0.1, f"reward did not rise: {rewards}"
