"""The bring-your-own-task cluster tests' run spec and Runs API calls (test_byo.py,
test_byo_qwen3_tools.py): a 2-step run on the demo model, submitted and watched to its
end, and what it logged."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import yaml

from marl.local.launcher import Cluster
from marl.models.demo import demo_model_dir
from marl.protocol.v1 import learner_pb2, learner_pb2_grpc


def base_spec(name: str, out: Path, **changes: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": name,
        "workflow": "single",
        "out_dir": str(out),
        "model": {"path": str(demo_model_dir())},
        "lora": {"rank": 4, "alpha": 8},
        "optim": {"lr": 1e-2, "warmup_steps": 0},
        "grpo": {"group_size": 4, "mini_batch_size": 2},
        "train": {"steps": 2, "problems_per_step": 2, "val_interval": 1000,
                  "val_problems": 2, "checkpoint_interval": 1000, "rollouts_logged": 8,
                  "step_timeout_s": 300},
        "sampling": {"temperature": 1.5, "max_tokens": 8},
        "data": {"train": "arithmetic", "val": "arithmetic"},
    }
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict) and key != "data":
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return spec


def stub(cluster: Cluster) -> learner_pb2_grpc.LearnerStub:
    return learner_pb2_grpc.LearnerStub(grpc.insecure_channel(cluster.endpoints()["learner"]))


def train(cluster: Cluster, spec: dict[str, Any]) -> learner_pb2.Run:
    s = stub(cluster)
    run_id = s.SubmitRun(learner_pb2.SubmitRunRequest(spec_yaml=yaml.safe_dump(spec)),
                         timeout=120).run_id
    for _ in s.WatchRun(learner_pb2.WatchRunRequest(run_id=run_id, from_start=True),
                        timeout=900):
        pass
    return s.GetRun(learner_pb2.GetRunRequest(run_id=run_id), timeout=10)


def records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def rollouts(out: Path, step: int) -> list[dict[str, Any]]:
    path = out / "rollouts" / f"step_{step:06d}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]
