"""A real Voting run logs the role drift signals, and `marl report` / `marl watch` read its
directory: every service a process, the shipped demo model (no warm start to wait for),
three validations.

What it proves: the learner writes each step's signatures of its training episodes
(`sig/<role>/...`, what the alarms read) and of every validation's transcripts
(`val/sig/<role>/...`), with the numbers `role_signatures` gives on the saved transcripts;
the report built from the run directory has every plot and one transcript per role at the
first, best and last step; the live view draws the run's per-role table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from rich.console import Console

from marl.diagnostics.signatures import role_signatures
from marl.local.launcher import Cluster
from marl.models.demo import demo_model_dir
from marl.monitor.report import write_report
from marl.monitor.watch import watch_dir
from marl.protocol.v1 import learner_pb2, learner_pb2_grpc
from marl.rollout import Rollout

pytestmark = pytest.mark.timeout(600)

PLOTS = (
    "reward_accuracy.png",
    "role_dynamics.png",
    "grad_share.png",
    "role_lengths.png",
    "role_signatures.png",
)


def spec(model_dir: Path, out: Path) -> dict[str, Any]:
    """The demo's settings (its model answers in 4-7 tokens), scaled down to 2 steps."""
    return {
        "name": "drift-signals",
        "workflow": "voting",
        "policy": "shared",
        "out_dir": str(out),
        "model": {"path": str(model_dir)},
        "lora": {"rank": 16, "alpha": 32},
        "optim": {"lr": 1e-3, "warmup_steps": 0, "schedule": "constant"},
        "grpo": {"group_size": 2},
        "train": {
            "steps": 2,
            "problems_per_step": 2,
            "val_interval": 1,
            "val_problems": 2,
            "checkpoint_interval": 1000,
            "step_timeout_s": 180,
            "rollouts_logged": 4,
        },
        "sampling": {"temperature": 1.0, "max_tokens": 8},
        "data": {"train": "arithmetic", "val": "arithmetic"},
    }


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_dir = demo_model_dir()
    base = tmp_path_factory.mktemp("drift")
    cluster = Cluster(base / "cluster", str(model_dir), engine="transformers")
    cluster.start()
    try:
        stub = learner_pb2_grpc.LearnerStub(grpc.insecure_channel(cluster.endpoints()["learner"]))
        out = base / "run"
        run_id = stub.SubmitRun(
            learner_pb2.SubmitRunRequest(spec_yaml=yaml.safe_dump(spec(model_dir, out))),
            timeout=60,
        ).run_id
        for _ in stub.WatchRun(
            learner_pb2.WatchRunRequest(run_id=run_id, from_start=True), timeout=500
        ):
            pass
        run = stub.GetRun(learner_pb2.GetRunRequest(run_id=run_id), timeout=10)
        assert run.state == "SUCCEEDED", run.error
    finally:
        cluster.stop()
    return out


def test_learner_logs_train_and_validation_signatures(run_dir: Path) -> None:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows:  # a validation at every step (val_interval 1)
        for role in ("generator", "aggregator"):
            assert 0 <= row[f"val/sig/{role}/truncation_rate"] <= 1
            assert row[f"val/sig/{role}/len_p50"] <= 8  # sampling.max_tokens
        assert 0 <= row["val/sig/generator/jaccard3"] <= 1
        assert 0 <= row["val/sig/aggregator/terse_rate"] <= 1
        assert "val/sig/aggregator/jaccard3" not in row  # one aggregator slot
        assert isinstance(row.get("alarms", []), list)
    for row in rows[1:]:
        assert {"sig/generator/jaccard3", "sig/aggregator/terse_rate"} <= set(row)
        # rollouts_logged (4) of the step's 4 episodes are saved: the learner's numbers are
        # the saved transcripts' numbers
        saved = [
            Rollout.from_dict(json.loads(line))
            for line in (run_dir / "rollouts" / f"step_{row['step']:06d}.jsonl")
            .read_text()
            .splitlines()
        ]
        assert len(saved) == 4
        for key, value in role_signatures(saved, "voting").items():
            assert row[key] == pytest.approx(value), key


def test_report_and_watch_read_the_run_directory(run_dir: Path, tmp_path: Path) -> None:
    page = write_report(run_dir, tmp_path)
    html = page.read_text()
    for name in PLOTS:
        assert (tmp_path / name).stat().st_size > 1000
        assert f'src="{name}"' in html
    for label in ("first", "best", "last"):
        for role in ("generator", "aggregator"):
            assert f"{label} (step" in html and f"&mdash; {role}" in html
    console = Console(record=True, width=200, force_terminal=False)
    assert watch_dir(run_dir, follow=False, console=console) == 0
    screen = console.export_text()
    assert "step 2/2" in screen and "DONE" in screen
    assert "generator" in screen and "aggregator" in screen and "χ²/first" in screen
