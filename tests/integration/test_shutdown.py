"""Every service exits within its drain time plus 10 s (issue 70): SIGTERMed with Redis gone,
and orphaned (its launcher SIGKILLed) with Redis reachable or gone.

Each case is a whole cluster of real processes (inference, workflow worker, sandbox,
learner) with a run in training, so the learner and the worker hold work when they are
stopped. The bound per service is its drain time (the worker's `drain_s`, 20 s; the
learner's, 100 s, to checkpoint the step it is on; none for the others) plus 10 s, counted from the signal or from the launcher's death.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from marl.local.launcher import Cluster
from marl.protocol.v1 import learner_pb2, learner_pb2_grpc
from marl.spec.services import LearnerConfig, WorkflowConfig
from tests.support.specs import demo_model_dir, small_spec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BOUND_S = {
    "workflow": WorkflowConfig().drain_s + 10,
    "learner": LearnerConfig().drain_s + 10,  # it checkpoints the step it is on first
    "inference": 10.0,
    "sandbox": 10.0,
}


def gone(pid: int) -> bool:
    """Exited (a zombie not yet reaped by whoever inherited it counts: it runs no more)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def start_training(learner: str, out: Path) -> None:
    """Submit a long Voting run and return once its first step is logged: the learner and
    the worker are busy with it."""
    stub = learner_pb2_grpc.LearnerStub(grpc.insecure_channel(learner))
    spec = small_spec("shutdown", out, steps=200, group=4, problems=4)
    request = learner_pb2.SubmitRunRequest(spec_yaml=json.dumps(spec))
    run_id = stub.SubmitRun(request, timeout=60).run_id
    deadline = time.monotonic() + 300
    while stub.GetRun(learner_pb2.GetRunRequest(run_id=run_id), timeout=10).step < 1:
        assert time.monotonic() < deadline, "the run logged no step"
        time.sleep(0.5)


def wait_all_gone(pids: dict[int, str], since: float) -> dict[str, float]:
    """Seconds from `since` to each process's exit; a service past its bound is killed
    and reported."""
    took: dict[str, float] = {}
    late: list[str] = []
    while len(took) + len(late) < len(pids):
        now = time.monotonic()
        for pid, kind in pids.items():
            if kind in took or kind in late:
                continue
            if gone(pid):
                took[kind] = now - since
            elif now - since > BOUND_S[kind] + 30:
                os.kill(pid, signal.SIGKILL)
                late.append(kind)
        time.sleep(0.1)
    print(f"exit times (s): {took}, still running past bound + 30 s: {late}")
    assert not late, f"{late} did not exit"
    return took


def test_each_service_sigtermed_with_redis_gone_exits_in_time(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path / "cluster", str(demo_model_dir()))
    cluster.start()
    try:
        start_training(cluster.endpoints()["learner"], tmp_path / "run")
        assert cluster.redis is not None and cluster.redis.proc is not None
        cluster.redis.proc.kill()
        cluster.redis.proc.wait()
        time.sleep(1.0)  # the services notice: their next commands fail and retry
        pids = {p.proc.pid: p.kind for p in cluster.processes}
        since = time.monotonic()
        for p in cluster.processes:
            p.proc.send_signal(signal.SIGTERM)
        took = wait_all_gone(pids, since)
        for p in cluster.processes:
            p.proc.wait()
        for kind, seconds in took.items():
            assert seconds <= BOUND_S[kind], f"{kind} took {seconds:.1f}s to exit"
    finally:
        cluster.stop()


LAUNCHER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from marl.local.launcher import Cluster

    workdir, model, redis_url = Path(sys.argv[1]), sys.argv[2], sys.argv[3] or None
    cluster = Cluster(workdir, model, redis_url=redis_url)
    cluster.start()
    cluster.write_endpoints(workdir / "endpoints.json")
    time.sleep(3600)
    """
)


@pytest.mark.parametrize("redis", ["reachable", "gone"])
def test_each_service_whose_launcher_is_sigkilled_exits_in_time(
    tmp_path: Path, redis: str, request: pytest.FixtureRequest
) -> None:
    """`gone`: the launcher's private Redis dies with it. `reachable`: a Redis of the
    test's own outlives the launcher."""
    redis_url = request.getfixturevalue("redis_url") if redis == "reachable" else ""
    workdir = tmp_path / "cluster"
    workdir.mkdir()
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(workdir), str(demo_model_dir()), redis_url],
        stdout=open(tmp_path / "launcher.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    endpoints: dict[str, Any] = {}
    pids: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 400
        while not (workdir / "endpoints.json").exists():
            assert launcher.poll() is None, (tmp_path / "launcher.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the cluster did not start"
            time.sleep(0.5)
        endpoints = json.loads((workdir / "endpoints.json").read_text())
        pids = {pid: kind for kind, ps in endpoints["pids"].items() for pid in ps}
        start_training(endpoints["learner"], tmp_path / "run")
        launcher.kill()
        launcher.wait()
        took = wait_all_gone(pids, time.monotonic())
        for kind, seconds in took.items():
            assert seconds <= BOUND_S[kind], f"{kind} took {seconds:.1f}s to exit"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in pids:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
