"""`marl demo` end to end: every service a process, a real run, and the workflow learns.

The acceptance bar of the demo: the trained Voting workflow's validation accuracy at
least 20 points above the untrained (step 0) value and at least 0.70 (validation samples
at the rollout temperature, seeded per problem and slot), AND its any-format accuracy (the
right sum, boxed or not) at least 10 points above, so that RL improved the answers and
not only their format; under both policy routings, with training reward rising.

The shared-policy run also lands where users look: TensorBoard scalars per role,
metrics.jsonl alarms and signatures, and a `marl report` page with every plot (checked
on its output rather than on a demo run of its own).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(1500)
@pytest.mark.parametrize(("policy", "seed"), [("shared", 0), ("isolated", 1)])
def test_demo_learns(tmp_path: Path, policy: str, seed: int) -> None:
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "marl.cli", "demo", "--out", str(out), f"policy={policy}",
         f"seed={seed}"],
        capture_output=True, text=True, timeout=1400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    print(proc.stdout[-2500:])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    vals = [r for r in rows if "val/accuracy" in r]
    accuracy = [r["val/accuracy"] for r in vals]
    any_format = [r["val/any_format_correct"] for r in vals]
    rewards = [r["train/reward_mean"] for r in rows if "train/reward_mean" in r]
    assert rows[0]["step"] == 0 and "val/accuracy" in rows[0]
    assert accuracy[-1] >= accuracy[0] + 0.20, f"validation accuracy rose < 20 points: {accuracy}"
    assert accuracy[-1] >= 0.70, f"validation accuracy ended under 0.70: {accuracy}"
    assert any_format[-1] >= any_format[0] + 0.10, (
        f"any-format accuracy rose < 10 points: {any_format}"
    )
    head, tail = rewards[:10], rewards[-10:]
    assert sum(tail) / len(tail) > sum(head) / len(head) + 0.1, f"reward did not rise: {rewards}"
    if policy == "shared":
        check_sinks_and_report(out, tmp_path / "report", steps=rows[-1]["step"])


def check_sinks_and_report(out: Path, report: Path, steps: int) -> None:
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    for role in ("generator", "aggregator"):
        for signal in ("chi2_token", "update_chi2", "training_ppl", "grad_norm", "grad_share",
                       "entropy"):
            assert f"role/{role}/{signal}" in scalars
        assert f"sig/{role}/len_p50" in scalars
    assert "sig/aggregator/terse_rate" in scalars and "val/accuracy" in scalars
    assert [e.step for e in events.Scalars("role/generator/chi2_token")] == list(
        range(1, steps + 1)
    )
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(isinstance(x["alarms"], list) for x in lines)
    subprocess.run(
        [sys.executable, "-m", "marl.cli", "report", str(out), "--out", str(report)],
        check=True,
        timeout=300,
    )
    html = (report / "report.html").read_text()
    for png in ("reward_accuracy", "role_dynamics", "grad_share", "role_lengths",
                "role_signatures"):
        assert (report / f"{png}.png").is_file() and f'src="{png}.png"' in html
