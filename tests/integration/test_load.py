"""Load: 8 workflow workers and 2 sandboxes run 200 episodes at once, step after step, for
over two minutes. No episode fails, nothing is dead-lettered, no service logs a traceback,
and every service's resident memory in the last minute is within 10 % of the first's.

Every service is a real process on a real Redis. The run uses the test-only parity
workflow (the model's reply becomes a program the sandbox runs), so every episode makes
an inference call and a sandbox call; each step is 50 problems x a group of 4.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import grpc
import pytest
import yaml
from parity_workflow import PARITY_REF, write_problems

from marl.local.launcher import Cluster
from marl.protocol.v1 import learner_pb2, learner_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.chaos, pytest.mark.timeout(900)]

PROBLEMS, GROUP = 50, 4
LOAD_S = 130.0
SAMPLE_S = 2.0


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def spec(model_dir: Path, data: Path, out: Path) -> dict:
    return {
        "name": "load",
        "workflow": PARITY_REF,
        "policy": "shared",
        "out_dir": str(out),
        "model": {"path": str(model_dir)},
        "lora": {"rank": 4, "alpha": 8},
        "optim": {"lr": 1e-3, "warmup_steps": 0},
        "grpo": {"group_size": GROUP},
        "train": {
            "steps": 1000,
            "problems_per_step": PROBLEMS,
            "val_interval": 100_000,
            "val_problems": 2,
            "checkpoint_interval": 100_000,
            "step_timeout_s": 300,
        },
        "sampling": {"temperature": 2.0, "max_tokens": 6},
        "data": {"train": "deepcoder", "val": "deepcoder",
                 "train_path": str(data), "val_path": str(data)},
    }


def test_eight_workers_two_sandboxes_two_minutes(tiny_model_dir: Path, tmp_path: Path) -> None:
    cluster = Cluster(tmp_path / "cluster", str(tiny_model_dir), workflow_replicas=8,
                      sandbox_replicas=2, threads={"inference": 1, "learner": 1,
                                                   "workflow": 1, "sandbox": 1})
    with cluster:
        learner = learner_pb2_grpc.LearnerStub(
            grpc.insecure_channel(cluster.endpoints()["learner"])
        )
        out = tmp_path / "run"
        data = write_problems(tmp_path / "parity.jsonl", n=400)
        run_id = learner.SubmitRun(learner_pb2.SubmitRunRequest(
            spec_yaml=yaml.safe_dump(spec(tiny_model_dir, data, out))), timeout=60).run_id
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not metrics.exists() or len(metrics.read_text().splitlines()) < 2:
            assert time.monotonic() < deadline, "step 1 never ended"
            time.sleep(0.5)
        services = {p.log_path.stem: p.proc.pid for p in cluster.processes}
        samples: dict[str, list[tuple[float, int]]] = {name: [] for name in services}
        start = time.monotonic()
        while time.monotonic() - start < LOAD_S:
            for name, pid in services.items():
                samples[name].append((time.monotonic() - start, rss_kb(pid)))
            time.sleep(SAMPLE_S)
        learner.CancelRun(learner_pb2.CancelRunRequest(run_id=run_id), timeout=30)
        run = learner.GetRun(learner_pb2.GetRunRequest(run_id=run_id), timeout=30)
        assert cluster.dead() == []
        logs = {p.log_path.stem: p.log_path.read_text() for p in cluster.processes}

    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert len(steps) >= 3
    assert all(r["train/episode_errors"] == 0 for r in steps), [
        r["train/episode_errors"] for r in steps
    ]
    assert run.dead_lettered == 0
    assert {name: "Traceback" in text for name, text in logs.items()} == {
        name: False for name in logs
    }
    report = []
    for name, series in samples.items():
        first = statistics.median(kb for t, kb in series if t < 60)
        last = statistics.median(kb for t, kb in series if t >= LOAD_S - 60)
        report.append(f"{name}: {first / 1024:.0f} -> {last / 1024:.0f} MiB")
        assert abs(last - first) <= 0.10 * first, report
    print(f"\n{len(steps)} steps of {PROBLEMS * GROUP} episodes; RSS (median, first minute -> "
          "last):\n" + "\n".join(report))
