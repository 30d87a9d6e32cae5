"""Several learner processes take runs from the one queue in Redis: two learners that train
one run at a time each train one of two runs submitted together, at the same time, and
either learner answers the Runs API for both (`marl up --learners`, the chart's
`learner.replicas`).

Every service is a real process on loopback with a real Redis.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from marl.local.launcher import Cluster
from marl.protocol.v1 import learner_pb2, learner_pb2_grpc
from tests.support.runs import rows, submit, wait_end
from tests.support.specs import demo_model_dir, small_spec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 6


def test_two_learners_each_train_one_of_two_runs_at_once(tmp_path: Path) -> None:
    with Cluster(tmp_path / "cluster", str(demo_model_dir()), engine="transformers",
                 sandbox_replicas=0, learner_replicas=2, max_concurrent_runs=1) as c:
        learners = [p for p in c.processes if p.kind == "learner"]
        assert len(learners) == 2
        outs = [tmp_path / "a", tmp_path / "b"]
        run_ids = [submit(c, small_spec(out.name, out, steps=STEPS, group=4, problems=2)) for out in outs]
        both_running = False
        deadline = time.monotonic() + 300
        while not both_running:
            assert time.monotonic() < deadline, "the two runs never trained at the same time"
            both_running = all(0 < len(rows(out)) <= STEPS for out in outs)
            time.sleep(0.05)
        for run_id in run_ids:
            assert wait_end(c, run_id).state == "SUCCEEDED"
        for p in learners:  # either learner answers for every run
            stub = learner_pb2_grpc.LearnerStub(grpc.insecure_channel(p.address))
            for run_id in run_ids:
                run = stub.GetRun(learner_pb2.GetRunRequest(run_id=run_id), timeout=10)
                assert run.state == "SUCCEEDED" and run.step == STEPS
        trained = [[r for r in run_ids if f"training run {r}" in p.log_path.read_text()]
                   for p in learners]
        assert sorted(map(len, trained)) == [1, 1], trained
        assert {r for t in trained for r in t} == set(run_ids)
