"""The Runs API of a launcher `Cluster`'s learner, and its services' state, as the cluster
tests drive them: submit, watch or wait for the end, read what was logged, find a busy
worker, stop a service gracefully, wait for a condition."""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
import yaml

from marl.local.launcher import Cluster, Process
from marl.protocol.v1 import learner_pb2, learner_pb2_grpc

T = TypeVar("T")


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


def run_to_end(cluster: Cluster, spec: dict[str, Any], timeout_s: float = 800) -> learner_pb2.Run:
    """Submit `spec` and follow the run's events (WatchRun) to its end."""
    learner = stub(cluster)
    run_id = submit(cluster, spec)
    request = learner_pb2.WatchRunRequest(run_id=run_id, from_start=True)
    for _ in learner.WatchRun(request, timeout=timeout_s):
        pass
    return learner.GetRun(learner_pb2.GetRunRequest(run_id=run_id), timeout=10)


def wait_for(predicate: Callable[[], T], timeout_s: float, what: str) -> T:
    """`predicate()`'s first truthy value, polled every 0.1 s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def kill_learner(cluster: Cluster) -> None:
    """SIGKILL the cluster's first learner and forget it (`start_learner` replaces it)."""
    cluster.kill(next(p for p in cluster.processes if p.kind == "learner"))


def start_learner(cluster: Cluster) -> Process:
    """A new learner on new ports, once it serves; it takes over the runs of a killed one."""
    return cluster.add("learner", cluster.learner_args())


def resume_spec(model_dir: Path, out_dir: Path) -> dict:
    return {
        "name": "resume",
        "workflow": "voting",
        "policy": "isolated",
        "out_dir": str(out_dir),
        "model": {"path": str(model_dir)},
        "lora": {"rank": 4, "alpha": 8},
        "optim": {"lr": 1e-2, "warmup_steps": 0},
        "grpo": {"group_size": 4, "mini_batch_size": 4},
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


def wait_for_rows(out: Path, n: int) -> None:
    """Until the run's metrics.jsonl holds `n` steps (polled often: a demo step is short)."""
    deadline = time.monotonic() + 300
    while not (out / "metrics.jsonl").exists() or len(rows(out)) < n:
        assert time.monotonic() < deadline
        time.sleep(0.02)
