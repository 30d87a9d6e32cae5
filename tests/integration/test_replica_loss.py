"""An inference replica that dies mid-run does not end the run: the learner's pushes skip
it (the others acknowledged), workers fail over to the replicas that are left, and once
its heartbeat expires nothing is sent to it any more. Every service is a real process.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
import yaml

from marl.launcher import Cluster
from marl.v1 import learner_pb2, learner_pb2_grpc

pytestmark = pytest.mark.timeout(600)  # the session's tiny model may be built first

STEPS = 8


def spec(model_dir: Path, out_dir: Path) -> dict[str, Any]:
    return {
        "name": "it-replica-loss",
        "workflow": "voting",
        "policy": "shared",
        "out_dir": str(out_dir),
        "model": {"path": str(model_dir)},
        "lora": {"rank": 4, "alpha": 8},
        "optim": {"lr": 1e-2, "warmup_steps": 0},
        "grpo": {"group_size": 2},
        "caps": {"voting_candidates": 1},
        "train": {
            "steps": STEPS,
            "problems_per_step": 2,
            "val_interval": 1000,
            "val_problems": 2,
            "checkpoint_interval": 1000,
            "rollouts_logged": 0,
            "step_timeout_s": 120,
        },
        "sampling": {"temperature": 2.0, "max_tokens": 4},
        "data": {"train": "arithmetic", "val": "arithmetic"},
    }


def steps_done(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    return max((json.loads(line)["step"] for line in metrics.read_text().splitlines()), default=0)


def test_run_survives_the_loss_of_one_inference_replica(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cluster = Cluster(
        tmp_path / "cluster",
        str(tiny_model_dir),
        inference_replicas=2,
        sandbox_replicas=0,
        threads={"inference": 1, "learner": 1, "workflow": 1},
    )
    cluster.start()
    try:
        assert cluster.redis_url is not None
        r = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
        learner = learner_pb2_grpc.LearnerStub(
            grpc.insecure_channel(cluster.endpoints()["learner"])
        )
        out = tmp_path / "run"
        run_id = learner.SubmitRun(
            learner_pb2.SubmitRunRequest(spec_yaml=yaml.safe_dump(spec(tiny_model_dir, out))),
            timeout=60,
        ).run_id
        deadline = time.monotonic() + 300
        while steps_done(out / "metrics.jsonl") < 2:
            assert time.monotonic() < deadline, "the run did not reach step 2"
            time.sleep(0.1)

        victim = [p for p in cluster.processes if p.kind == "inference"][0]
        victim.proc.send_signal(signal.SIGKILL)  # no goodbye: its registry entry stays behind
        victim.proc.wait(timeout=30)
        killed_at = steps_done(out / "metrics.jsonl")

        for _ in learner.WatchRun(
            learner_pb2.WatchRunRequest(run_id=run_id, from_start=True), timeout=500
        ):
            pass
        run = learner.GetRun(learner_pb2.GetRunRequest(run_id=run_id), timeout=10)
        assert run.state == "SUCCEEDED", run.error
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [row["step"] for row in rows] == list(range(STEPS + 1))
        assert all(row["train/episode_errors"] == 0 for row in rows[1:])

        # every version after the loss was acknowledged by the surviving replica only
        acks: Any = r.hgetall(f"marl:run:{run_id}:acks")
        by_version: dict[int, set[str]] = {}
        for key in acks:
            replica, ref = key.split("/", 1)
            by_version.setdefault(int(ref.split("@")[1]), set()).add(replica)
        assert len(by_version[0]) == 2
        assert all(len(by_version[v]) == 1 for v in range(killed_at + 1, STEPS + 1))
    finally:
        cluster.stop()
