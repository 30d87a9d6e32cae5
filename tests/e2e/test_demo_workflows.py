"""`marl demo` runs every multi-agent workflow of the paper, not only Voting: Eval-Opt and
Orch-Workers each train 2 steps on the demo model under shared and isolated routing,
every service a real process, and each role trains its own adapter under isolation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROLES = {
    "eval_opt": ("generator", "evaluator"),
    "orch_workers": ("orchestrator", "worker", "synthesizer"),
}


@pytest.mark.slow


@pytest.mark.e2e
@pytest.mark.timeout(600)
@pytest.mark.parametrize("policy", ["shared", "isolated"])
@pytest.mark.parametrize("workflow", ["eval_opt", "orch_workers"])
def test_demo_runs_the_workflow(tmp_path: Path, workflow: str, policy: str) -> None:
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "marl.cli", "demo", "--out", str(out), "--steps", "2",
         f"workflow={workflow}", f"policy={policy}", "train.val_interval=2",
         "train.val_problems=10"],
        capture_output=True, text=True, timeout=550,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "val/accuracy" in rows[0] and "val/accuracy" in rows[-1]
    adapters = {"shared"} if policy == "shared" else set(ROLES[workflow])
    for row in rows[1:]:
        assert row["train/episode_errors"] == 0
        trained = {k.split("/")[1] for k in row if k.startswith("policy/") and k.endswith("/loss")}
        assert trained == adapters, (row["step"], sorted(trained))
    assert (out / "checkpoints" / "latest").read_text() == "step_000002"
