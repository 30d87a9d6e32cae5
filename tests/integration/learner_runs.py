"""Runs on a launcher `Cluster` driven through the learner's Runs API, for the fault tests
(learner, worker and Redis kills): submit, wait for the end, read what was logged."""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import yaml

from marl.local.launcher import Cluster, Process
from marl.protocol.v1 import learner_pb2, learner_pb2_grpc


def demo_model_dir() -> Path:
    from marl.models.demo import demo_model_dir as shipped

    return shipped()


def voting_spec(name: str, out_dir: Path, steps: int, group: int, problems: int) -> dict[str, Any]:
    """A shared-adapter Voting run on the shipped demo model: small steps, no validation
    after step 0, no checkpoints, every rollout logged."""
    return {
        "name": name,
        "workflow": "voting",
        "policy": "shared",
        "out_dir": str(out_dir),
        "model": {"path": str(demo_model_dir())},
        "lora": {"rank": 4, "alpha": 8},
        "optim": {"lr": 1e-2, "warmup_steps": 0},
        "grpo": {"group_size": group, "mini_batch_size": problems},
        "train": {
            "steps": steps,
            "problems_per_step": problems,
            "val_interval": 1000,
            "val_problems": 2,
            "checkpoint_interval": 1000,
            "rollouts_logged": group * problems,
            "step_timeout_s": 300,
        },
        "sampling": {"temperature": 1.5, "max_tokens": 12},
        "data": {"train": "arithmetic", "val": "arithmetic"},
    }


def stub(cluster: Cluster) -> learner_pb2_grpc.LearnerStub:
    """The newest learner's (a replacement's, after a kill)."""
    address = [p.address for p in cluster.processes if p.kind == "learner"][-1]
    return learner_pb2_grpc.LearnerStub(grpc.insecure_channel(address))


def submit(cluster: Cluster, spec: dict[str, Any]) -> str:
    request = learner_pb2.SubmitRunRequest(spec_yaml=yaml.safe_dump(spec))
    return str(stub(cluster).SubmitRun(request, timeout=60).run_id)


def wait_end(cluster: Cluster, run_id: str, timeout_s: float = 600) -> learner_pb2.Run:
    """The run once it ended; a learner that does not answer (killed, not yet replaced) is
    asked again."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            run = stub(cluster).GetRun(learner_pb2.GetRunRequest(run_id=run_id), timeout=10)
        except grpc.RpcError:
            time.sleep(1)
            continue
        if run.state in ("SUCCEEDED", "FAILED", "CANCELLED"):
            return run
        time.sleep(0.5)
    logs = cluster.dump_stacks()
    raise AssertionError(
        f"run {run_id} did not end in {timeout_s}s; the services' stacks are in their logs: {logs}"
    )


def rows(out: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's records so far (none before the first is logged)."""
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def sigterm(p: Process) -> int:
    """SIGTERM a service and wait for its exit code."""
    p.proc.send_signal(signal.SIGTERM)
    return p.proc.wait(timeout=60)


def inflight_episodes(worker: Process) -> float:
    """The episodes a workflow worker runs now (its Prometheus gauge)."""
    url = f"http://{worker.http_address}/metrics"
    for line in urllib.request.urlopen(url, timeout=5).read().decode().splitlines():
        if line.startswith("marl_inflight_episodes "):
            return float(line.split()[1])
    raise AssertionError(f"the worker at {worker.http_address} exports no marl_inflight_episodes")


def busy_worker(cluster: Cluster) -> Process:
    """A worker running episodes now."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for worker in (p for p in cluster.processes if p.kind == "workflow"):
            if inflight_episodes(worker) > 0:
                return worker
    raise AssertionError("no worker ran an episode")
