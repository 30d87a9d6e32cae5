"""A slow but live worker keeps its tasks: inference is paused (SIGSTOP) for longer than the
workers' heartbeat TTL while they hold episodes, and nothing is claimed from them, run
twice or dropped as a duplicate; the run completes once inference resumes.

Every service is a real process on a real Redis; two workers, so a wrong claim has
someone to claim for.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from marl.local.launcher import Cluster, Process
from tests.support.runs import busy_worker, inflight_episodes, rows, submit, wait_end
from tests.support.specs import demo_model_dir, small_spec

pytestmark = [pytest.mark.slow, pytest.mark.chaos, pytest.mark.timeout(600)]

HEARTBEAT_TTL_S = 5.0  # the workers' default
PAUSE_S = 2 * HEARTBEAT_TTL_S
SETTLE_S = 1.0


def stop_while_episodes_wait(cluster: Cluster, inference: Process) -> None:
    """SIGSTOP inference at a moment a worker holds episodes that wait on it.

    The gauge is read again once inference has been stopped for SETTLE_S: a step's
    rollouts take a fraction of a second here, so the episodes seen before the stop may
    all have finished by then, and the pause would then fall between steps.
    """
    workers = [p for p in cluster.processes if p.kind == "workflow"]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        busy_worker(cluster)
        inference.proc.send_signal(signal.SIGSTOP)
        time.sleep(SETTLE_S)
        if any(inflight_episodes(w) > 0 for w in workers):
            return
        inference.proc.send_signal(signal.SIGCONT)
    raise AssertionError("inference was never stopped while a worker held episodes")


def test_workers_waiting_on_a_paused_engine_keep_their_tasks(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, str(demo_model_dir()), workflow_replicas=2, sandbox_replicas=0)
    cluster.start()
    try:
        out = tmp_path / "run"
        run_id = submit(cluster, small_spec("slow", out, steps=6, group=4, problems=4))
        deadline = time.monotonic() + 300
        while len(rows(out)) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        inference = next(p for p in cluster.processes if p.kind == "inference")
        stop_while_episodes_wait(cluster, inference)
        time.sleep(PAUSE_S - SETTLE_S)
        inference.proc.send_signal(signal.SIGCONT)
        run = wait_end(cluster, run_id)
        assert run.state == "SUCCEEDED", run.error
        assert run.duplicate_rollouts == 0
        assert run.dead_lettered == 0
        logs = [p.log_path.read_text() for p in cluster.processes if p.kind == "workflow"]
        assert not any("from dead consumer" in text for text in logs)
        logged = rows(out)
        assert [r["step"] for r in logged] == list(range(7))
        assert all(r["train/episode_errors"] == 0 for r in logged if r["step"] > 0)
        assert max(r["time/rollout_s"] for r in logged if r["step"] > 0) >= PAUSE_S - 1
    finally:
        cluster.stop()
