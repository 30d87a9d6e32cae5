"""`marl demo data.train_path=FILE`: the demo trains and validates on the user's own file.

FILE is a JSONL in the published DAPO-Math schema (verl's RL format): every training
rollout is one of its problems, and validation runs on the quarter of it held out
(`data.val_fraction`), not on the demo's 200 bundled arithmetic pairs.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from marl.data.dapo import INSTRUCTION_HEAD, INSTRUCTION_TAIL

ROWS = 40


def write_problems(path: Path) -> set[str]:
    rng = random.Random(3)
    ids = set()
    with path.open("w") as f:
        for i in range(ROWS):
            a, b = rng.randrange(50), rng.randrange(50)
            row = {
                "data_source": "math_dapo",
                "prompt": [{"role": "user",
                            "content": f"{INSTRUCTION_HEAD}What is {a}+{b}?{INSTRUCTION_TAIL}"}],
                "ability": "MATH",
                "reward_model": {"ground_truth": str(a + b), "style": "rule-lighteval/MATH_v2"},
                "extra_info": {"index": f"own-{i}"},
            }
            f.write(json.dumps(row) + "\n")
            ids.add(f"own-{i}")
    return ids


@pytest.mark.slow  # a whole `marl demo`: 25-60 s on 2 cores
@pytest.mark.e2e
def test_demo_trains_and_validates_on_a_jsonl_file(tmp_path: Path) -> None:
    ids = write_problems(tmp_path / "mine.jsonl")
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "marl.cli", "demo", "--out", str(out), "--steps", "2",
         f"data.train_path={tmp_path / 'mine.jsonl'}", "data.val_fraction=0.25",
         "train.problems_per_step=4", "train.val_interval=2"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = yaml.safe_load((out / "run.yaml").read_text())["data"]
    assert data["train_path"] == str(tmp_path / "mine.jsonl")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    vals = [r for r in rows if "val/accuracy" in r]
    assert [r["step"] for r in vals] == [0, 2]
    assert all(r["val/problems"] == ROWS // 4 for r in vals)  # the file's held-out quarter
    trained = {
        json.loads(line)["problem_id"].removeprefix("dapo-")
        for f in sorted((out / "rollouts").glob("*.jsonl"))
        for line in f.read_text().splitlines()
    }
    assert trained and trained <= ids
