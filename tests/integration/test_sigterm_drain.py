"""SIGTERM each service under load: no call fails that another replica or a retry could serve.

- The sandbox, under 8 callers running jobs back to back: SIGTERMed and started again on
  its port, every call ends PASSED (in-flight jobs finish; calls made meanwhile wait for the
  restarted server and retry), and the server exits 0.
- A training run on two inference replicas and two workers: one inference replica, one
  worker and the learner are SIGTERMed in turn mid-run and started again. Each exits 0 (the
  worker after finishing the episodes it held: they were kept waiting on inference, paused
  with SIGSTOP, when it got SIGTERM), and the run succeeds with no episode failed, no task
  dead-lettered and every step once.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest

from marl.clients.sandbox import AsyncSandboxClient
from marl.local.launcher import Cluster, Process
from tests.support.runs import busy_worker, inflight_episodes, rows, sigterm, submit, wait_end
from tests.support.specs import demo_model_dir, small_spec

pytestmark = [pytest.mark.slow, pytest.mark.chaos, pytest.mark.timeout(900)]

JOB = "import time\ntime.sleep(0.3)\nprint(int(input()) * 2)\n"


def test_sandbox_sigterm_and_restart_under_load(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, str(demo_model_dir()), inference_replicas=0,
                      workflow_replicas=0, learner=False, sandbox_replicas=1)
    cluster.start()
    try:
        sandbox = cluster.processes[0]
        verdicts: list[list[str]] = []
        errors: list[BaseException] = []

        async def caller(client: AsyncSandboxClient, until: list[float]) -> None:
            i = 0
            while time.monotonic() < until[0]:
                i += 1
                try:
                    result = await client.execute(
                        JOB, [{"stdin": f"{i}\n", "expected_stdout": f"{2 * i}\n"}]
                    )
                    verdicts.append(result.verdicts)
                except Exception as err:  # every failure is counted, none expected
                    errors.append(err)

        async def load() -> int:
            client = AsyncSandboxClient(sandbox.address)
            until = [time.monotonic() + 3600.0]
            callers = [asyncio.create_task(caller(client, until)) for _ in range(8)]
            await asyncio.sleep(3.0)
            before = len(verdicts)
            code = await asyncio.to_thread(sigterm, sandbox)
            await asyncio.to_thread(cluster.restart, sandbox)
            await asyncio.sleep(3.0)
            until[0] = time.monotonic()
            await asyncio.gather(*callers)
            await client.close()
            assert before > 0 and len(verdicts) > before
            return code

        assert asyncio.run(load()) == 0
        assert errors == []
        assert all(v == ["PASSED"] for v in verdicts)
    finally:
        cluster.stop()


def busy_with_replicas_stopped(cluster: Cluster) -> Process:
    """A worker with an episode waiting on the inference replicas, which are stopped
    (SIGSTOP): found busy, the replicas stopped, and still busy a second later (an episode
    past its last generation, scoring or sending, finishes meanwhile). A stop that lands
    between steps, when no episode runs and the next step's tasks wait for an adapter push
    that the stopped replicas cannot ack, is undone and tried again."""
    replicas = [q for q in cluster.processes if q.kind == "inference"]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        worker = busy_worker(cluster)
        for replica in replicas:
            replica.proc.send_signal(signal.SIGSTOP)
        time.sleep(1.0)
        if inflight_episodes(worker) > 0:
            return worker
        for replica in replicas:
            replica.proc.send_signal(signal.SIGCONT)
    raise AssertionError("no worker kept an episode in flight with the replicas stopped")


def test_inference_worker_and_learner_sigterm_mid_run(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, str(demo_model_dir()), inference_replicas=2,
                      workflow_replicas=2, sandbox_replicas=0)
    cluster.start()
    try:
        out = tmp_path / "run"
        steps = 24
        spec = small_spec("sigterm", out, steps=steps, group=4, problems=4)
        spec["train"]["checkpoint_interval"] = 1
        run_id = submit(cluster, spec)
        exits = {}
        for kind in ("inference", "workflow", "learner"):
            deadline = time.monotonic() + 300
            after = len(rows(out)) + 2
            while len(rows(out)) < after:
                assert time.monotonic() < deadline, f"step {after} was not reached"
                time.sleep(0.1)
            p = next(p for p in cluster.processes if p.kind == kind)
            assert len(rows(out)) <= steps, f"the run ended before the {kind} was stopped"
            if kind == "workflow":  # held up on inference, its episodes are under way
                p = busy_with_replicas_stopped(cluster)
                p.proc.send_signal(signal.SIGTERM)
                time.sleep(1.0)
                for replica in (q for q in cluster.processes if q.kind == "inference"):
                    replica.proc.send_signal(signal.SIGCONT)
            exits[kind] = sigterm(p)
            cluster.restart(p)
        run = wait_end(cluster, run_id)
        assert run.state == "SUCCEEDED", run.error
        assert exits == {"inference": 0, "workflow": 0, "learner": 0}
        assert run.dead_lettered == 0
        logged = rows(out)
        assert [r["step"] for r in logged] == list(range(steps + 1))
        assert [r["train/episode_errors"] for r in logged if r["step"] > 0] == [0] * steps
        assert all(r.get("val/episode_errors", 0) == 0 for r in logged)
        logs = [p.log_path.read_text() for p in cluster.processes if p.kind == "workflow"]
        assert sum("stopping: draining" in text for text in logs) == 1
        assert sum("drained; 0 episodes handed back" in text for text in logs) == 1
    finally:
        cluster.stop()


def test_inference_stops_promptly_when_redis_is_gone(tmp_path: Path) -> None:
    """Its registration key expires by itself: a dead Redis does not hold SIGTERM up."""
    cluster = Cluster(tmp_path, str(demo_model_dir()), workflow_replicas=0, learner=False,
                      sandbox_replicas=0)
    cluster.start()
    try:
        assert cluster.redis is not None
        cluster.redis.kill()
        started = time.monotonic()
        assert sigterm(cluster.processes[0]) == 0
        assert time.monotonic() - started < 10.0
    finally:
        cluster.stop()
