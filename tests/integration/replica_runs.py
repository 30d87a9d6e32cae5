"""What the replica tests share: a long small run, its submission, and waiting."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import grpc
import yaml

from marl.local.launcher import Cluster
from marl.protocol.v1 import learner_pb2, learner_pb2_grpc


def small_run_spec(
    model_dir: Path, out_dir: Path, name: str, policy: str, steps: int
) -> dict[str, Any]:
    """Many quick steps (2 problems × 2 samples, one Voting candidate, 4 tokens)."""
    return {
        "name": name,
        "workflow": "voting",
        "policy": policy,
        "out_dir": str(out_dir),
        "model": {"path": str(model_dir)},
        "lora": {"rank": 4, "alpha": 8},
        "optim": {"lr": 1e-2, "warmup_steps": 0},
        "grpo": {"group_size": 2},
        "caps": {"voting_candidates": 1},
        "train": {
            "steps": steps,
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


def submit(cluster: Cluster, spec: dict[str, Any]) -> tuple[learner_pb2_grpc.LearnerStub, str]:
    learner = learner_pb2_grpc.LearnerStub(grpc.insecure_channel(cluster.endpoints()["learner"]))
    request = learner_pb2.SubmitRunRequest(spec_yaml=yaml.safe_dump(spec))
    return learner, learner.SubmitRun(request, timeout=60).run_id


def wait_for(predicate: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
