"""A learner killed with SIGKILL mid-step: another learner takes the run over under the same
run id from its last checkpoint, and the steps after it equal an uninterrupted run's.

Every service is a real process on a real Redis; sampling is seeded per turn (the seed
derives from the run seed and the task, not the run id), so two runs of one spec see
the same rollouts.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import grpc
import pytest
import yaml

from marl.launcher import Cluster, Process
from marl.v1 import learner_pb2, learner_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def resume_spec(model_dir: Path, out_dir: Path) -> dict:
    return {
        "name": "resume",
        "workflow": "voting",
        "policy": "isolated",
        "out_dir": str(out_dir),
        "model": {"path": str(model_dir)},
        "lora": {"rank": 4, "alpha": 8},
        "optim": {"lr": 1e-2, "warmup_steps": 0},
        "grpo": {"group_size": 4, "mini_batch_size": 16},
        "train": {
            "steps": 3,
            "problems_per_step": 4,
            "val_interval": 3,
            "val_problems": 4,
            "checkpoint_interval": 1,
            "step_timeout_s": 300,
        },
        "sampling": {"temperature": 1.5, "max_tokens": 6},
        "data": {"train": "arithmetic", "val": "arithmetic"},
    }


def stub(cluster: Cluster) -> learner_pb2_grpc.LearnerStub:
    address = [p.address for p in cluster.processes if p.kind == "learner"][-1]
    return learner_pb2_grpc.LearnerStub(grpc.insecure_channel(address))


def submit(cluster: Cluster, spec: dict) -> str:
    request = learner_pb2.SubmitRunRequest(spec_yaml=yaml.safe_dump(spec))
    return str(stub(cluster).SubmitRun(request, timeout=60).run_id)


def wait_end(cluster: Cluster, run_id: str, timeout_s: float = 600) -> learner_pb2.Run:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            run = stub(cluster).GetRun(learner_pb2.GetRunRequest(run_id=run_id), timeout=10)
        except grpc.RpcError:
            time.sleep(1)
            continue
        if run.state in ("SUCCEEDED", "FAILED", "CANCELLED"):
            return run
        time.sleep(1)
    raise AssertionError(f"run {run_id} did not end in {timeout_s}s")


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_sigkill_mid_step_resumes_under_the_same_run_id(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from marl.demo_model import demo_model_dir

    # the demo model ships warm-started: its rewards vary within a group, so losses do too
    tiny_model_dir = demo_model_dir()
    work = tmp_path_factory.mktemp("cluster")
    with Cluster(work, str(tiny_model_dir), engine="transformers", sandbox_replicas=0) as cluster:
        plain = work / "plain"
        run = wait_end(cluster, submit(cluster, resume_spec(tiny_model_dir, plain)))
        assert run.state == "SUCCEEDED", run.error

        killed = work / "killed"
        run_id = submit(cluster, resume_spec(tiny_model_dir, killed))
        # step 1 is logged (its checkpoint written): step 2's rollouts are under way
        deadline = time.monotonic() + 300
        while not (killed / "metrics.jsonl").exists() or len(rows(killed)) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        time.sleep(0.5)
        learner: Process = [p for p in cluster.processes if p.kind == "learner"][0]
        os.killpg(learner.proc.pid, signal.SIGKILL)
        learner.proc.wait(timeout=30)
        cluster.processes.remove(learner)
        logged = rows(killed)
        assert logged[-1]["step"] in (1, 2)

        assert cluster.redis_url is not None
        replacement = cluster._spawn(
            "learner", ["--redis", cluster.redis_url, "--runs-dir", str(work / "runs")]
        )
        import asyncio

        asyncio.run(cluster._wait([replacement], 300))
        run = wait_end(cluster, run_id)
        assert run.state == "SUCCEEDED", run.error
        assert run.run_id == run_id

    uninterrupted, resumed = rows(plain), rows(killed)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]  # each step once: cut back, re-run
    for a, b in zip(uninterrupted[1:], resumed[1:], strict=True):
        for key in ("train/reward_mean", "policy/generator/loss", "policy/aggregator/loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (b["step"], key)
    assert resumed[-1]["val/accuracy"] == uninterrupted[-1]["val/accuracy"]
    # the resumed run's adapters took versions no replica had seen
    turns = [
        json.loads(line)["turns"]
        for line in (killed / "rollouts" / "step_000003.jsonl").read_text().splitlines()
    ]
    assert all(t["adapter"]["version"] > 3 for ts in turns for t in ts)
