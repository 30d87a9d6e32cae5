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

import pytest
import redis

from marl.local.launcher import Cluster
from marl.protocol.v1 import learner_pb2
from services.learner.runs import acks_key
from tests.support.runs import stub, submit, wait_for
from tests.support.specs import small_spec

pytestmark = pytest.mark.timeout(600)  # the session's tiny model may be built first

STEPS = 8


def steps_done(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    return max((json.loads(line)["step"] for line in metrics.read_text().splitlines()), default=0)


def ends_whole(learner: Any, run_id: str, out: Path) -> None:
    """Waits for the run's end: SUCCEEDED, every step logged, no episode failed."""
    for _ in learner.WatchRun(
        learner_pb2.WatchRunRequest(run_id=run_id, from_start=True), timeout=500
    ):
        pass
    run = learner.GetRun(learner_pb2.GetRunRequest(run_id=run_id), timeout=10)
    assert run.state == "SUCCEEDED", run.error
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(STEPS + 1))
    assert all(row["train/episode_errors"] == 0 for row in rows[1:])


def test_run_survives_the_loss_of_one_inference_replica(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cluster = Cluster(
        tmp_path / "cluster",
        str(tiny_model_dir),
        inference_replicas=2,
        sandbox_replicas=0,
    )
    cluster.start()
    try:
        assert cluster.redis_url is not None
        r = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
        out = tmp_path / "run"
        spec = small_spec(
            "it-replica-loss", out, tiny_model_dir, policy="shared", steps=STEPS, group=2,
            rollouts_logged=0, step_timeout_s=120, temperature=2.0, max_tokens=4,
            caps={"voting_candidates": 1},
        )
        run_id = submit(cluster, spec)
        learner = stub(cluster)
        wait_for(lambda: steps_done(out / "metrics.jsonl") >= 2, 300, "the run to reach step 2")

        victim = [p for p in cluster.processes if p.kind == "inference"][0]
        victim.proc.send_signal(signal.SIGKILL)  # no goodbye: its registry entry stays behind
        victim.proc.wait(timeout=30)
        killed_at = steps_done(out / "metrics.jsonl")

        ends_whole(learner, run_id, out)

        # every version after the loss was acknowledged by the surviving replica only
        acks: Any = r.hgetall(acks_key(run_id))
        by_version: dict[int, set[str]] = {}
        for key in acks:
            replica, ref = key.split("/", 1)
            by_version.setdefault(int(ref.split("@")[1]), set()).add(replica)
        assert len(by_version[0]) == 2
        assert all(len(by_version[v]) == 1 for v in range(killed_at + 1, STEPS + 1))
    finally:
        cluster.stop()


@pytest.mark.slow  # make test-chaos


@pytest.mark.chaos
def test_run_rides_out_the_restart_of_its_only_inference_replica(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The only replica is killed mid-run and started again on its address (as a crashed
    container is): turns and pushes wait for it instead of failing, and once the learner
    has pushed it the run's adapters, the run goes on with no episode lost."""
    cluster = Cluster(
        tmp_path / "cluster", str(tiny_model_dir), inference_replicas=1, sandbox_replicas=0
    )
    cluster.start()
    try:
        out = tmp_path / "run"
        spec = small_spec(
            "it-replica-restart", out, tiny_model_dir, policy="shared", steps=STEPS, group=2,
            rollouts_logged=0, step_timeout_s=120, temperature=2.0, max_tokens=4,
            caps={"voting_candidates": 1},
        )
        run_id = submit(cluster, spec)
        learner = stub(cluster)
        wait_for(lambda: steps_done(out / "metrics.jsonl") >= 2, 300, "the run to reach step 2")

        victim = next(p for p in cluster.processes if p.kind == "inference")
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(timeout=30)
        killed_at = steps_done(out / "metrics.jsonl")
        time.sleep(2.0)  # episodes and the learner find no replica meanwhile
        assert steps_done(out / "metrics.jsonl") <= killed_at + 1
        cluster.restart(victim)  # returns once it serves: the learner pushed it the adapters

        ends_whole(learner, run_id, out)
        assert killed_at < STEPS, "the run ended before its replica was killed"
    finally:
        cluster.stop()
