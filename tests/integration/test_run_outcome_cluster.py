"""A run's outcome is honest about failed episodes (issue 70).

Every service is a real process on a real Redis. A workflow fails most episodes of every
other training step on purpose (tests/integration/failing_workflows.py): those steps are
failed steps (above `train.max_failed_fraction`), the run ends FAILED because more than
`train.max_failed_steps` of its steps failed, and the run record GetRun returns, `marl
status` and every step's record give the counts. The same run with `max_failed_steps: 1`
ends SUCCEEDED with the same counts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from marl.cli import main as cli
from marl.local.launcher import Cluster
from marl.protocol.v1 import learner_pb2
from tests.support.runs import submit, wait_end

pytestmark = [pytest.mark.timeout(900), pytest.mark.cluster(model_fixture="tiny_model_dir", sandbox_replicas=0)]

PROBLEMS, GROUP, STEPS = 2, 4, 4
WORKFLOW = "tests.integration.failing_workflows:EVERY_OTHER_STEP"


def spec(model_dir: Path, out: Path, **train: float) -> dict:
    return {
        "name": "it-outcome",
        "workflow": WORKFLOW,
        "policy": "shared",
        "seed": 1,
        "out_dir": str(out),
        "model": {"path": str(model_dir)},
        "lora": {"rank": 4, "alpha": 8},
        "optim": {"lr": 1e-2, "warmup_steps": 0},
        "grpo": {"group_size": GROUP, "mini_batch_size": PROBLEMS},
        "train": {
            "steps": STEPS,
            "problems_per_step": PROBLEMS,
            "val_interval": 1000,
            "val_problems": 2,
            "checkpoint_interval": 1000,
            "step_timeout_s": 300,
            **train,
        },
        "sampling": {"temperature": 1.5, "max_tokens": 6},
        "data": {"train": "arithmetic", "val": "arithmetic"},
    }


FAILED_EPISODES = (STEPS // 2) * PROBLEMS * (GROUP - 1)


def check_counts(run: learner_pb2.Run, out: Path) -> None:
    assert run.steps_done == STEPS
    assert run.failed_steps == STEPS // 2
    assert run.episodes == STEPS * PROBLEMS * GROUP
    assert run.failed_episodes == FAILED_EPISODES
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["step"] > 0]
    assert [r["train/failed_step"] for r in trained] == [0, 1, 0, 1]
    assert [r["train/episode_errors"] for r in trained] == [0, 6, 0, 6]
    assert all(r["train/episodes"] == PROBLEMS * GROUP for r in trained)


def test_a_run_whose_every_other_step_mostly_fails_ends_failed_with_the_counts(
    tiny_model_dir: Path, tmp_path: Path, cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    run_id = submit(cluster, spec(tiny_model_dir, out))
    run = wait_end(cluster, run_id)
    assert run.state == "FAILED", run.error
    assert run.error.startswith(f"2 of {STEPS} steps failed"), run.error
    assert f"{FAILED_EPISODES} of {STEPS * PROBLEMS * GROUP} episodes failed" in run.error
    check_counts(run, out)

    learner = cluster.endpoints()["learner"]
    assert cli.main(["status", run_id, "--learner", learner]) == 0
    shown = capsys.readouterr().out
    assert "FAILED" in shown
    assert f"failed steps: 2 of {STEPS}  failed episodes: {FAILED_EPISODES} of 32" in shown
    assert cli.main(["status", run_id, "--learner", learner, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert (status["failed_steps"], status["failed_episodes"]) == (2, FAILED_EPISODES)


def test_max_failed_steps_one_lets_the_same_run_succeed(
    tiny_model_dir: Path, tmp_path: Path, cluster: Cluster
) -> None:
    out = tmp_path / "run"
    run = wait_end(cluster, submit(cluster, spec(tiny_model_dir, out, max_failed_steps=1)))
    assert run.state == "SUCCEEDED", run.error
    check_counts(run, out)
