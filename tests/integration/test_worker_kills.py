"""SIGKILL a workflow worker mid-episode, again and again, during one run: the run completes,
every step trains on exactly its group size of rollouts per problem, none counted twice,
none lost, and no step takes more than 30 s longer than an undisturbed one.

Every service is a real process on a real Redis. A worker is killed only while it holds
tasks (it has unacknowledged entries in the tasks stream: an episode under way), at most
once a step (so the bound on a step's time tests recovery, not a pile of kills), and a
replacement is started each time. Workers heartbeat a key that lives
`MARL_WORKFLOW_HEARTBEAT_TTL_S` seconds, so a killed worker's tasks move within seconds.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from pathlib import Path

import pytest
import redis

from marl.local.launcher import Cluster, Process
from marl.protocol.v1 import learner_pb2
from marl.runtime import streams
from tests.support.runs import rows, stub, submit, wait_end
from tests.support.specs import small_spec

KILLS = 12
GROUP = 4
PROBLEMS = 4
WORKERS = 3

pytestmark = [
    pytest.mark.slow, pytest.mark.chaos, pytest.mark.timeout(900),
    # max_deliveries stays at its default: a delivery whose worker died is not a failure,
    # so a task under several of the kills must not be dead-lettered for them
    pytest.mark.cluster(
        env={"MARL_WORKFLOW_HEARTBEAT_TTL_S": "3", "MARL_WORKFLOW_CONCURRENCY": "4"},
        sandbox_replicas=0, workflow_replicas=WORKERS,
    ),
]


def holders(r: redis.Redis, workers: list[Process]) -> list[Process]:
    """The live workers that hold tasks of the step under way (an episode in progress:
    an unacknowledged entry the learner has not deleted yet)."""
    summary = r.xpending(streams.TASKS, streams.WORKERS_GROUP)
    out = []
    for c in summary.get("consumers") or []:
        pending = r.xpending_range(
            streams.TASKS, streams.WORKERS_GROUP, min="-", max="+", count=100,
            consumername=c["name"],
        )
        live = any(r.xrange(streams.TASKS, p["message_id"], p["message_id"]) for p in pending)
        out += [
            p for p in workers
            if live and p.proc.poll() is None and f"-{p.proc.pid}-" in c["name"]
        ]
    return out


def logged(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def step_seconds(out: Path) -> list[float]:
    return [row["time/step_s"] for row in rows(out) if "time/step_s" in row]


def check_rollouts(out: Path, steps: int) -> int:
    """Every step: each problem exactly GROUP rollouts, task ids unique, none failed."""
    for step in range(1, steps + 1):
        lines = (out / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()
        logged = [json.loads(line) for line in lines]
        assert len(logged) == GROUP * PROBLEMS, step
        ids = [r["task_id"] for r in logged]
        assert len(set(ids)) == len(ids), f"step {step}: a rollout counted twice"
        per_problem = Counter(r["problem_id"] for r in logged)
        assert len(per_problem) == PROBLEMS and set(per_problem.values()) == {GROUP}, step
        assert sorted(r["sample"] for r in logged) == sorted(list(range(GROUP)) * PROBLEMS)
        assert all(r["error"] is None for r in logged), step
    return steps


def test_twelve_sigkilled_workers_lose_and_double_count_nothing(cluster: Cluster) -> None:
    c = cluster
    assert c.redis_url is not None
    r = redis.Redis.from_url(c.redis_url, decode_responses=True)

    plain = c.workdir / "plain"
    t0 = time.monotonic()
    run = wait_end(c, submit(c, small_spec(
        "kills", plain, steps=3, group=GROUP, problems=PROBLEMS)),
    )
    assert run.state == "SUCCEEDED", run.error
    undisturbed = step_seconds(plain)
    print(f"undisturbed: {time.monotonic() - t0:.0f}s, steps {[round(s, 1) for s in undisturbed]}")

    steps = 16
    out = c.workdir / "killed"
    t0 = time.monotonic()
    run_id = submit(c, small_spec("kills", out, steps=steps, group=GROUP, problems=PROBLEMS))
    rng = random.Random(0)
    killed_in = 0
    """Steps logged when the last kill fell: the next waits for the next step's rollouts."""
    kills = 0
    kill_times: list[float] = []
    deadline = time.monotonic() + 600
    while kills < KILLS:
        assert time.monotonic() < deadline, f"only {kills} kills"
        state = stub(c).GetRun(learner_pb2.GetRunRequest(run_id=run_id), timeout=10).state
        assert state in ("QUEUED", "RUNNING"), f"the run ended ({state}) after {kills} kills"
        if logged(out) <= killed_in:  # one kill a step: the step it hit has not ended yet
            time.sleep(0.1)
            continue
        workers = [p for p in c.processes if p.kind == "workflow"]
        held = holders(r, workers)
        if not held:
            time.sleep(0.1)
            continue
        victim = rng.choice(held)
        c.kill(victim)
        killed_in = logged(out)
        kills += 1
        kill_times.append(time.monotonic() - t0)
        # the replacement; the next kill waits for it, so the fleet never runs dry
        c.add("workflow", ["--redis", str(c.redis_url)], timeout_s=120)
    run = wait_end(c, run_id)
    seconds = time.monotonic() - t0
    assert run.state == "SUCCEEDED", run.error
    disturbed = step_seconds(out)
    print(
        f"disturbed: {seconds:.0f}s, {kills} kills at {[round(t) for t in kill_times]}s, "
        f"steps {[round(s, 1) for s in disturbed]}, duplicates dropped {run.duplicate_rollouts}"
    )
    assert kill_times[-1] < seconds  # every kill fell inside the run
    assert len(disturbed) == steps
    assert max(disturbed) <= max(undisturbed) + 30.0
    check_rollouts(out, steps)
    assert all(row.get("train/episode_errors", 0) == 0 for row in rows(out) if row["step"] > 0)
    assert run.dead_lettered == 0
    assert r.xlen(streams.dead_letter_stream(streams.TASKS)) == 0
    assert r.xpending(streams.TASKS, streams.WORKERS_GROUP)["pending"] == 0
