"""What a user reads of a step: the line `marl demo` prints for it, and the
rollouts the learner logs."""

from __future__ import annotations

import json
from pathlib import Path

from marl.monitor.progress import format_step
from marl.rollout import Rollout
from services.learner.sinks import RolloutLog


def test_a_step_line_names_failed_episodes_and_where_to_look() -> None:
    m = {"step": 4, "train/reward_mean": 0.017, "train/accuracy": 0.02, "time/step_s": 0.4,
         "train/episode_errors": 116, "val/episode_errors": 0}
    assert format_step(m, 6) == (
        "step    4/6  reward +0.017  train acc 0.02  0.4s/step  "
        "116 EPISODES FAILED (rollouts/step_000004.jsonl)"
    )
    clean = {**m, "train/episode_errors": 0, "val/accuracy": 0.5, "val/episode_errors": 2}
    assert format_step(clean, 6) == (
        "step    4/6  reward +0.017  train acc 0.02  VAL ACC 0.500  0.4s/step  "
        "2 VALIDATION EPISODES FAILED"
    )


def test_the_rollout_log_keeps_a_failed_episode_when_the_sample_has_none(
    tmp_path: Path,
) -> None:
    def rollout(k: int, error: str | None = None) -> Rollout:
        return Rollout(f"t{k}", "r", 4, "train", f"p{k // 4}", k % 4, [], "", 0.0, error=error)

    log = RolloutLog(tmp_path, per_step=4)
    log.write(4, [rollout(k, "NoReplica: not loaded" if k in (5, 6) else None)
                  for k in range(16)])
    lines = (tmp_path / "step_000004.jsonl").read_text().splitlines()
    assert [json.loads(line)["task_id"] for line in lines] == ["t0", "t4", "t8", "t5"]
    assert json.loads(lines[-1])["error"] == "NoReplica: not loaded"
    log.write(5, [rollout(k, "x" if k == 4 else None) for k in range(16)])  # picked already
    lines = (tmp_path / "step_000005.jsonl").read_text().splitlines()
    assert [json.loads(line)["task_id"] for line in lines] == ["t0", "t4", "t8", "t12"]


def test_follow_run_prints_each_step_and_returns_the_final_state() -> None:
    import io
    import json
    from types import SimpleNamespace

    from marl.monitor.progress import follow_run

    def event(state: str, metrics: dict[str, object] | None) -> SimpleNamespace:
        run = SimpleNamespace(state=state, total_steps=2)
        return SimpleNamespace(run=run, metrics_json=json.dumps(metrics) if metrics else "")

    events = [
        event("RUNNING", {"step": 1, "val/accuracy": 0.25}),
        event("RUNNING", {"note": "no step"}),
        event("RUNNING", {"step": 2, "val/accuracy": 0.5}),
        event("FAILED", None),
    ]
    stub = SimpleNamespace(WatchRun=lambda req: iter(events))
    out = io.StringIO()
    assert follow_run(stub, "r-1", out=out) == "FAILED"
    assert out.getvalue().splitlines() == [
        "step    1/2  VAL ACC 0.250",
        "step    2/2  VAL ACC 0.500",
        "run r-1 FAILED",
    ]
