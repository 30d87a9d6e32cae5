"""A real `marl demo` run lands where users look: TensorBoard scalars per role, metrics.jsonl
alarms and signatures, and a `marl report` page with every plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


@pytest.mark.slow


@pytest.mark.e2e
def test_demo_run_writes_tensorboard_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "marl.cli", "demo", "--out", str(out), "--steps", "3"]
    subprocess.run(cmd, check=True, timeout=900)
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    for role in ("generator", "aggregator"):
        for signal in ("chi2_token", "update_chi2", "training_ppl", "grad_norm", "grad_share", "entropy"):
            assert f"role/{role}/{signal}" in scalars
        assert f"sig/{role}/len_p50" in scalars
    assert "sig/aggregator/terse_rate" in scalars and "val/accuracy" in scalars
    assert [e.step for e in events.Scalars("role/generator/chi2_token")] == [1, 2, 3]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(isinstance(x["alarms"], list) for x in lines)
    report = tmp_path / "report"
    subprocess.run(
        [sys.executable, "-m", "marl.cli", "report", str(out), "--out", str(report)],
        check=True,
        timeout=300,
    )
    html = (report / "report.html").read_text()
    for png in (
        "reward_accuracy",
        "role_dynamics",
        "grad_share",
        "role_lengths",
        "role_signatures",
    ):
        assert (report / f"{png}.png").is_file() and f'src="{png}.png"' in html
