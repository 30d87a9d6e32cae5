"""SIGTERM a learner mid-run: within the grace the chart gives it, it abandons the step whose
rollouts it is gathering, writes a checkpoint of the steps it has done (the run checkpoints
no other step) and exits 0; a new learner resumes the run from that checkpoint, and every
step is logged once.

Every service is a real process on a real Redis. The workers are paused (SIGSTOP) before
the SIGTERM so that the learner is certainly waiting on a step's rollouts when it arrives.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from marl.spec.services import LearnerConfig
from tests.support.cluster import ClusterFactory
from tests.support.runs import rows, start_learner, submit, wait_end
from tests.support.specs import small_spec

pytestmark = [pytest.mark.slow, pytest.mark.resume, pytest.mark.timeout(900)]

STEPS = 8
CHART_GRACE_S = LearnerConfig().drain_s + 20  # deploy/helm/templates/learner.yaml


def test_sigterm_mid_run_checkpoints_the_current_step_and_the_run_resumes(
    tmp_path: Path, clusters: ClusterFactory
) -> None:
    cluster = clusters(sandbox_replicas=0)
    try:
        out = tmp_path / "run"
        spec = small_spec("sigterm-checkpoint", out, steps=STEPS, group=2, problems=2,
                          policy="shared")
        run_id = submit(cluster, spec)  # checkpoint_interval 1000: none before the stop
        deadline = time.monotonic() + 300
        while len(rows(out)) < 3:
            assert time.monotonic() < deadline, "step 2 was not reached"
            time.sleep(0.05)
        workers = [p for p in cluster.processes if p.kind == "workflow"]
        for w in workers:
            w.proc.send_signal(signal.SIGSTOP)
        learner = next(p for p in cluster.processes if p.kind == "learner")
        time.sleep(1.0)  # the step under way, if its rollouts were in, trains and is logged
        stopped = time.monotonic()
        learner.proc.send_signal(signal.SIGTERM)
        code = learner.proc.wait(timeout=CHART_GRACE_S)
        took = time.monotonic() - stopped
        for w in workers:
            w.proc.send_signal(signal.SIGCONT)
        assert code == 0
        assert took < CHART_GRACE_S
        done = rows(out)[-1]["step"]
        assert 2 <= done < STEPS, "the SIGTERM came after the run ended"
        checkpoints = out / "checkpoints"
        assert (checkpoints / "latest").read_text() == f"step_{done:06d}"
        assert sorted(p.name for p in checkpoints.glob("step_*")) == [f"step_{done:06d}"]
        log = learner.log_path.read_text()
        assert f"stopping: checkpointed run {run_id} at step {done}" in log

        cluster.processes.remove(learner)
        replacement = start_learner(cluster)
        run = wait_end(cluster, run_id)
        assert run.state == "SUCCEEDED", run.error
        assert f"resumed {run_id} at step {done}" in replacement.log_path.read_text()
        assert [r["step"] for r in rows(out)] == list(range(STEPS + 1))
    finally:
        for p in cluster.processes:  # none is left paused, whatever failed
            if p.proc.poll() is None:
                os.kill(p.proc.pid, signal.SIGCONT)
