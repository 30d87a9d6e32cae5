"""The sandbox dies mid-step: the episodes it could not score fail, are left out of their
groups, and every other rollout trains with the advantage it would have had if the
failed ones had never been sampled.

Every service is a real process on a real Redis. Two workers each score code on their
own sandbox; the first takes at most 4 episodes at once, the second 5 (not a whole
number of groups of 4: however a step's 24 tasks reach the workers, all at once or
one by one, the second holds part of a group), so a step's episodes spread over
the two. Once step 0 is logged (the learner is handing out step 1's tasks), the second
sandbox is killed with SIGKILL: that worker's episodes come back with `error` set (the
sandbox client waits for a sandbox to come back within the call's deadline, then gives
DEADLINE_EXCEEDED; UNAVAILABLE for a call cut when it died), the first worker's are scored. The step's rollouts are logged; replaying
them through `grpo_step` on a fresh policy built as the learner builds it gives the
learner's logged loss with or without the failed ones, and a different loss if they had
been scored 0.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import grpc
import pytest
import yaml
from grpo_replay import replay_shared_loss
from parity_workflow import MOSTLY_RIGHT_REF, write_problems

from marl.local.launcher import Cluster, Process
from marl.protocol.v1 import learner_pb2, learner_pb2_grpc, workflow_pb2, workflow_pb2_grpc
from marl.rollout import Rollout
from services.learner.advantages import good_rollouts, group_advantages

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROBLEMS, GROUP = 6, 4


def run_spec(model_dir: Path, data: Path, out: Path) -> dict:
    return {
        "name": "it-sandbox-lost",
        # most rewards 1: the rollouts a partly failed group keeps are rarely all 0, which
        # would leave the advantages the same with or without the failed ones
        "workflow": MOSTLY_RIGHT_REF,
        "policy": "shared",
        "seed": 5,
        "out_dir": str(out),
        "model": {"path": str(model_dir)},
        "lora": {"rank": 4, "alpha": 8},
        "optim": {"lr": 1e-2, "warmup_steps": 0},
        "grpo": {"group_size": GROUP, "mini_batch_size": PROBLEMS},
        "train": {
            "steps": 1,
            "problems_per_step": PROBLEMS,
            "val_interval": 1000,
            "val_problems": 2,
            "checkpoint_interval": 1000,
            "rollouts_logged": PROBLEMS * GROUP,
            "step_timeout_s": 300,
        },
        "sampling": {"temperature": 2.0, "max_tokens": 6},
        "data": {
            "train": "deepcoder",
            "val": "deepcoder",
            "train_path": str(data),
            "val_path": str(data),
        },
    }


def worker_id(address: str) -> str:
    stub = workflow_pb2_grpc.WorkflowStub(grpc.insecure_channel(address))
    return str(stub.GetStats(workflow_pb2.GetStatsRequest(), timeout=10).worker_id)


def wait_until_reading(workers: list[Process], timeout_s: float = 120.0) -> None:
    """A worker reports SERVING before it imports its tokenizer classes and makes its first
    task read (`import_tokenizers`); on a loaded machine that can outlast a whole step, and
    the other worker would take every task. Each logs when it starts reading."""
    deadline = time.monotonic() + timeout_s
    while not all("reading tasks from" in w.log_path.read_text() for w in workers):
        assert time.monotonic() < deadline, "a worker never started reading tasks"
        time.sleep(0.05)


def test_sandbox_killed_mid_step_leaves_its_episodes_out(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    raw = run_spec(tiny_model_dir, write_problems(tmp_path / "parity.jsonl"), out)
    cluster = Cluster(
        tmp_path / "cluster", str(tiny_model_dir), sandbox_replicas=2, workflow_replicas=0
    )
    with cluster:
        assert cluster.redis_url is not None
        kept_sandbox, lost_sandbox = [p for p in cluster.processes if p.kind == "sandbox"]
        workers = [
            cluster.add(
                "workflow",
                ["--redis", cluster.redis_url, "--sandbox", s.address, "--concurrency", n],
                wait=False,
            )
            for s, n in ((kept_sandbox, "4"), (lost_sandbox, "5"))
        ]
        cluster.wait_serving(workers, 300)
        kept_worker, lost_worker = (worker_id(w.address) for w in workers)
        wait_until_reading(workers)

        stub = learner_pb2_grpc.LearnerStub(grpc.insecure_channel(cluster.endpoints()["learner"]))
        run_id = stub.SubmitRun(
            learner_pb2.SubmitRunRequest(spec_yaml=yaml.safe_dump(raw)), timeout=60
        ).run_id
        deadline = time.monotonic() + 300
        while not (out / "metrics.jsonl").exists():  # step 0's validation scored on both
            assert time.monotonic() < deadline, "step 0 was never logged"
            time.sleep(0.05)
        cluster.kill(lost_sandbox, forget=False)
        for _ in stub.WatchRun(
            learner_pb2.WatchRunRequest(run_id=run_id, from_start=True), timeout=500
        ):
            pass
        run = stub.GetRun(learner_pb2.GetRunRequest(run_id=run_id), timeout=10)
    assert run.state == "SUCCEEDED", run.error

    row = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1]
    lines = (out / "rollouts" / "step_000001.jsonl").read_text().splitlines()
    rollouts = [Rollout.from_dict(json.loads(line)) for line in lines]
    assert len(rollouts) == PROBLEMS * GROUP
    failed = [r for r in rollouts if r.error is not None]
    by_worker = {w: sum(r.worker_id == w for r in rollouts) for w in (kept_worker, lost_worker)}
    assert failed, f"no episode failed; episodes per worker {by_worker}"
    assert all(r.worker_id == lost_worker and not r.turns for r in failed)
    assert all(
        "UNAVAILABLE" in str(r.error) or "DEADLINE_EXCEEDED" in str(r.error) for r in failed
    ), [r.error for r in failed]
    assert all(r.error is None for r in rollouts if r.worker_id == kept_worker)
    assert row["train/episode_errors"] == len(failed)

    groups = [r.problem_id for r in rollouts]
    keep, dropped = good_rollouts([r.error is not None for r in rollouts], groups)
    outcome = {
        g: [(r.reward, r.error is not None) for r in rollouts if r.problem_id == g]
        for g in dict.fromkeys(groups)
    }
    assert keep, f"every group was dropped: {outcome}"
    assert row["train/groups_dropped"] == dropped
    partial = {groups[i] for i in keep} & {r.problem_id for r in failed}
    assert partial, f"no kept group lost a rollout: {outcome}"
    assert row["train/sequences"] == len(keep)  # one generator turn per kept rollout

    # the learner's advantages: those of the good rollouts alone
    good = [rollouts[i] for i in keep]
    logged = row["policy/shared/loss"]
    assert replay_shared_loss(tiny_model_dir, raw, rollouts) == pytest.approx(logged, rel=1e-4, abs=1e-7)
    assert replay_shared_loss(tiny_model_dir, raw, good) == pytest.approx(logged, rel=1e-4, abs=1e-7)

    # scored 0 instead, the failed ones would have shifted their groups' advantages
    as_zero = [
        Rollout.from_dict({**r.to_dict(), "error": None, "reward": 0.0})
        if r.error is not None
        else r
        for r in rollouts
    ]
    with_zeros = group_advantages([r.reward for r in as_zero], groups)
    without = group_advantages([r.reward for r in good], [r.problem_id for r in good])
    shifted = [with_zeros[i] for i in keep]
    assert any(abs(a - b) > 1e-6 for a, b in zip(shifted, without, strict=True)), outcome
