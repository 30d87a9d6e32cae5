"""An agent written only against `openai.AsyncOpenAI` trains 2 steps, unchanged.

`examples/workflows/openai_agent.py` is named in the run spec; every service is
a real process, on the demo model that ships with marl. Its two roles get their own adapters (isolated routing), and
every call the agent made through the episode's endpoint is in the rollouts
as that role's turn, with prompt and completion token ids, one sampling
log-prob per completion token, and the adapter version that served it.
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
import yaml

from marl.local.launcher import Cluster
from marl.models.demo import demo_model_dir
from marl.protocol.v1 import learner_pb2, learner_pb2_grpc

pytestmark = pytest.mark.timeout(600)

WORKFLOW = "examples.workflows.openai_agent:AGENT"


def spec(model_dir: Path, out_dir: Path) -> dict:
    return {
        "name": "it-openai-agent",
        "workflow": WORKFLOW,
        "policy": "isolated",
        "out_dir": str(out_dir),
        "model": {"path": str(model_dir)},
        "lora": {"rank": 4, "alpha": 8},
        "optim": {"lr": 1e-2, "warmup_steps": 0},
        "grpo": {"group_size": 4},
        "train": {
            "steps": 2,
            "problems_per_step": 2,
            "val_interval": 1000,
            "val_problems": 2,
            "checkpoint_interval": 1000,
            "step_timeout_s": 120,
        },
        "sampling": {"temperature": 2.0, "max_tokens": 6},
        "data": {"train": "arithmetic", "val": "arithmetic"},
    }


def test_openai_agent_trains_two_steps(tmp_path: Path) -> None:
    out = tmp_path / "run"
    model_dir = demo_model_dir()
    cluster = Cluster(tmp_path / "cluster", str(model_dir), engine="transformers",
                      sandbox_replicas=0)
    cluster.start()
    try:
        stub = learner_pb2_grpc.LearnerStub(grpc.insecure_channel(cluster.endpoints()["learner"]))
        run_id = stub.SubmitRun(learner_pb2.SubmitRunRequest(
            spec_yaml=yaml.safe_dump(spec(model_dir, out))), timeout=60).run_id
        for _ in stub.WatchRun(learner_pb2.WatchRunRequest(run_id=run_id, from_start=True),
                               timeout=500):
            pass
        run = stub.GetRun(learner_pb2.GetRunRequest(run_id=run_id), timeout=10)
    finally:
        cluster.stop()
    assert run.state == "SUCCEEDED", run.error
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for step in (1, 2):
        rollouts = [json.loads(line) for line in
                    (out / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert rollouts
        for rollout in rollouts:
            turns = rollout["turns"]
            assert [t["role"] for t in turns] == ["drafter", "checker"]
            for turn in turns:
                assert turn["adapter"] == {"name": f"{run_id}/{turn['role']}",
                                           "version": step - 1}
                assert turn["prompt_ids"] and turn["completion_ids"]
                assert len(turn["logprobs"]) == len(turn["completion_ids"])
                assert all(lp <= 0 for lp in turn["logprobs"])
                assert 1 <= len(turn["completion_ids"]) <= 6  # the run's max_tokens applied
