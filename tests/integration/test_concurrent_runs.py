"""Concurrent runs (issue 70): one learner process (`learner.max_concurrent_runs` 2) and one
inference replica train two runs at once. Each run's turns are served only its own
adapters (checked on every rollout's `served_by`), both runs' per-step losses equal those
of the same runs trained alone, and a run cancelled mid-step leaves the run beside it to
finish SUCCEEDED.

Every service is a real process on loopback with a real Redis. Sampling is seeded per turn
(from the run seed and the task, not the run id) and the seeded sampler's draws do not
depend on the rows a batch holds (services/inference/sampling.py), so a run sees the same
rollouts alone or beside another; each run's torch work has its own generators on the
learner's shared torch thread (services/learner/run_lane.py).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from marl.local.launcher import Cluster
from marl.protocol.v1 import learner_pb2
from tests.support.cluster import learner_spans
from tests.support.runs import rows, stub, submit, wait_end
from tests.support.specs import small_spec

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.cluster(sandbox_replicas=0, max_concurrent_runs=2, traced=True),
]

GROUP = 4
PROBLEMS = 2
STEPS = 2


def spec(name: str, out: Path, policy: str, seed: int, steps: int = STEPS) -> dict[str, Any]:
    s = small_spec(name, out, steps=steps, group=GROUP, problems=PROBLEMS)
    s.update(policy=policy, seed=seed)
    return s


def run_states(cluster: Cluster, run_ids: list[str]) -> dict[str, learner_pb2.Run]:
    learner = stub(cluster)
    return {i: learner.GetRun(learner_pb2.GetRunRequest(run_id=i), timeout=10) for i in run_ids}


def losses(out: Path) -> list[dict[str, float]]:
    """Each trained step's losses and mean reward."""
    return [
        {k: v for k, v in r.items() if k.endswith("/loss") or k == "train/reward_mean"}
        for r in rows(out)
        if r["step"] >= 1
    ]


def assert_served_only_its_own(run_id: str, out: Path, steps: int) -> None:
    """Every turn of every rollout was served by one of the run's own adapters, at the
    version of the step."""
    for step in range(1, steps + 1):
        logged = (out / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()
        assert len(logged) == GROUP * PROBLEMS
        for line in logged:
            for turn in json.loads(line)["turns"]:
                name = turn["adapter"]["name"]
                assert name.startswith(f"{run_id}/"), (run_id, step, name)
                assert turn["adapter"]["version"] == step - 1


def test_two_runs_at_once_train_as_each_alone(cluster: Cluster, tmp_path: Path) -> None:
    specs = {"sp": ("shared", 0), "ip": ("isolated", 1)}
    alone = {}
    for name, (policy, seed) in specs.items():
        out = tmp_path / f"alone-{name}"
        run = wait_end(cluster, submit(cluster, spec(name, out, policy, seed)))
        assert run.state == "SUCCEEDED", run.error
        alone[name] = losses(out)

    outs = {name: tmp_path / f"together-{name}" for name in specs}
    ids = {
        name: submit(cluster, spec(name, outs[name], policy, seed))
        for name, (policy, seed) in specs.items()
    }
    both_running = False
    deadline = time.monotonic() + 300
    while True:
        states = {i: r.state for i, r in run_states(cluster, list(ids.values())).items()}
        both_running |= all(s == "RUNNING" for s in states.values())
        if all(s in ("SUCCEEDED", "FAILED", "CANCELLED") for s in states.values()):
            break
        assert time.monotonic() < deadline, states
        time.sleep(0.2)
    assert both_running, "the runs did not train at once"
    for name, run_id in ids.items():
        run = wait_end(cluster, run_id)
        assert run.state == "SUCCEEDED", run.error
        assert_served_only_its_own(run_id, outs[name], STEPS)
        together = losses(outs[name])
        assert len(together) == len(alone[name]) == STEPS
        assert together[-1].keys() == alone[name][-1].keys()
        for a, b in zip(alone[name], together, strict=True):
            assert b == pytest.approx(a, rel=0, abs=1e-6), name
        # the pages a step frees go back for the run beside it: a trim after every step
        # and one as the run ends (`RunExecutor.trim_each_step`)
        assert len(learner_spans(cluster, "heap trim", run=run_id)) == STEPS + 1, name
    # the runs' groups carried a signal: equal losses are not zeros on both sides
    assert any(v != 0 for r in alone["sp"] for k, v in r.items() if k.endswith("/loss"))


def test_a_run_cancelled_mid_step_leaves_the_other_to_finish(
    cluster: Cluster, tmp_path: Path
) -> None:
    cancelled_out, other_out = tmp_path / "cancelled", tmp_path / "other"
    cancelled = submit(cluster, spec("long", cancelled_out, "isolated", 1, steps=50))
    # long enough to outlast the cancel (it ends within the update under way, if one is)
    other = submit(cluster, spec("other", other_out, "shared", 0, steps=5))
    deadline = time.monotonic() + 300
    while len(rows(cancelled_out)) < 2:  # step 1 is logged: step 2 is under way
        assert time.monotonic() < deadline
        time.sleep(0.05)
    learner = stub(cluster)
    learner.CancelRun(learner_pb2.CancelRunRequest(run_id=cancelled), timeout=10)
    while (states := run_states(cluster, [cancelled, other]))[cancelled].state == "RUNNING":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert states[cancelled].state == "CANCELLED"
    assert states[other].state == "RUNNING", "the other run ended before the cancel"
    assert len(rows(cancelled_out)) < 51
    run = wait_end(cluster, other)
    assert run.state == "SUCCEEDED", run.error
    assert [r["step"] for r in rows(other_out)] == [0, 1, 2, 3, 4, 5]
    assert_served_only_its_own(other, other_out, 5)
