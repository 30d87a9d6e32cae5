"""A learner killed with SIGKILL mid-step, or in the middle of writing a checkpoint: another
learner takes the run over under the same run id from its last whole checkpoint, and the
steps after it equal an uninterrupted run's. Both kills again end to end: `marl up` restarts
the learner it lost, a run submitted with `marl submit` resumes, `marl status` reports it.

Every service is a real process on a real Redis; sampling is seeded per turn (the seed
derives from the run seed and the task, not the run id), so two runs of one spec see
the same rollouts.
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

import pytest

from marl.local.launcher import Cluster
from tests.support.runs import (
    kill_learner,
    resume_spec,
    rows,
    start_learner,
    submit,
    wait_end,
    wait_for_rows,
)
from tests.support.specs import demo_model_dir

pytestmark = [
    pytest.mark.slow, pytest.mark.resume, pytest.mark.timeout(900),
    # one cluster for both kills, and the uninterrupted run they are compared with
    pytest.mark.cluster(env=lambda work: stall_hook_env(work), sandbox_replicas=0),
]


STALL_HOOK = textwrap.dedent(
    """
    import os, sys, time

    if "learner" in sys.argv:
        import services.learner.checkpoint as checkpoint

        write = checkpoint.save_file

        def stall_once_in_step_2(tensors, filename, metadata=None):
            write(tensors, filename, metadata=metadata)
            marker = os.environ["MARL_TEST_STALL_MARKER"]
            if "killed_in_write/" in filename and ".step_000002.tmp" in filename \\
                    and not os.path.exists(marker):
                open(marker, "w").close()
                time.sleep(3600)

        checkpoint.save_file = stall_once_in_step_2
    """
)
"""A `sitecustomize` for the learner processes: the first time a run under a
`killed_in_write/` directory writes step 2's checkpoint, the learner stops after one
adapter file and touches a marker, so the test can SIGKILL it mid-write."""


def stall_hook_env(work: Path) -> dict[str, str]:
    """The environment under which learners started with it run STALL_HOOK."""
    hook = work / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(STALL_HOOK)
    return {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])),
        "MARL_TEST_STALL_MARKER": str(work / "stalled"),
    }


@pytest.fixture(scope="module")
def uninterrupted(cluster: Cluster) -> list[dict]:
    """The rows of the uninterrupted run both kills are compared with."""
    # the demo model ships warm-started: its rewards vary within a group, so losses do too
    plain = cluster.workdir / "plain"
    run = wait_end(cluster, submit(cluster, resume_spec(demo_model_dir(), plain)))
    assert run.state == "SUCCEEDED", run.error
    return rows(plain)


def assert_killed_mid_run(out: Path) -> None:
    """The kill came before the last step was logged; otherwise the test resumed nothing."""
    assert [r["step"] for r in rows(out)] in ([0, 1], [0, 1, 2]), rows(out)


def assert_resumed_equals_uninterrupted(uninterrupted: list[dict], out: Path) -> None:
    resumed = rows(out)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]  # each step once: cut back, re-run
    for a, b in zip(uninterrupted[1:], resumed[1:], strict=True):
        for key in ("train/reward_mean", "policy/generator/loss", "policy/aggregator/loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (b["step"], key)
    assert resumed[-1]["val/accuracy"] == uninterrupted[-1]["val/accuracy"]
    # the resumed run's adapters took versions no replica had seen
    turns = [
        json.loads(line)["turns"]
        for line in (out / "rollouts" / "step_000003.jsonl").read_text().splitlines()
    ]
    assert all(t["adapter"]["version"] > 3 for ts in turns for t in ts)


def test_sigkill_mid_step_resumes_under_the_same_run_id(
    cluster: Cluster, uninterrupted: list[dict],
) -> None:
    c = cluster
    killed = c.workdir / "killed_mid_step"
    run_id = submit(c, resume_spec(demo_model_dir(), killed))
    # step 1 is logged (its checkpoint written): step 2's rollouts are under way
    wait_for_rows(killed, 2)
    time.sleep(0.1)
    kill_learner(c)
    assert_killed_mid_run(killed)
    start_learner(c)
    run = wait_end(c, run_id)
    assert run.state == "SUCCEEDED", run.error
    assert run.run_id == run_id
    assert_resumed_equals_uninterrupted(uninterrupted, killed)


def test_sigkill_during_a_checkpoint_write_resumes_from_the_last_whole_one(
    cluster: Cluster, uninterrupted: list[dict],
) -> None:
    c = cluster
    killed = c.workdir / "killed_in_write"
    marker = Path(os.environ["MARL_TEST_STALL_MARKER"])
    run_id = submit(c, resume_spec(demo_model_dir(), killed))
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert time.monotonic() < deadline, "the learner never reached step 2's checkpoint"
        time.sleep(0.1)
    kill_learner(c)
    checkpoints = killed / "checkpoints"
    assert (checkpoints / ".step_000002.tmp").is_dir()  # half written when killed
    assert (checkpoints / "latest").read_text() == "step_000001"
    assert [r["step"] for r in rows(killed)] == [0, 1]
    start_learner(c)
    run = wait_end(c, run_id)
    assert run.state == "SUCCEEDED", run.error
    assert run.run_id == run_id
    assert not list(checkpoints.glob(".step_*.tmp"))
    assert_resumed_equals_uninterrupted(uninterrupted, killed)


def marl(*args: str, env: dict[str, str] | None = None) -> str:
    out = subprocess.run([sys.executable, "-m", "marl.cli", *args], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_marl_up_restarts_a_killed_learner_and_submitted_runs_resume(tmp_path: Path) -> None:
    """`marl up`, `marl submit`: an uninterrupted run, then SIGKILL the learner mid-step in a
    second run and mid-way through a checkpoint write in a third: `marl up` starts it again on
    its port each time, and each run ends SUCCEEDED under its id with the first run's steps."""
    env = {**os.environ, **stall_hook_env(tmp_path)}
    up = subprocess.Popen([sys.executable, "-m", "marl.cli", "up", "--dir", str(tmp_path / "up")],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        endpoints_file = tmp_path / "up" / "endpoints.json"
        deadline = time.monotonic() + 300
        while not endpoints_file.exists():
            assert up.poll() is None and time.monotonic() < deadline, up.stdout.read()  # type: ignore[union-attr]
            time.sleep(0.5)
        learner = json.loads(endpoints_file.read_text())["learner"]
        spec_file = tmp_path / "spec.yaml"

        def submit_cli(out: Path) -> str:
            spec_file.write_text(json.dumps(resume_spec(demo_model_dir(), out)))
            return marl("submit", str(spec_file), "--learner", learner, env=env).strip()

        def kill_learner_pid() -> int:
            pid = json.loads(endpoints_file.read_text())["pids"]["learner"][0]
            os.kill(pid, signal.SIGKILL)
            return int(pid)

        def wait_succeeded(run_id: str, killed_pid: int) -> None:
            deadline = time.monotonic() + 600
            while True:
                assert up.poll() is None, up.stdout.read()  # type: ignore[union-attr]
                assert time.monotonic() < deadline, f"run {run_id} did not end"
                try:
                    run = json.loads(marl("status", run_id, "--json", "--learner", learner))
                except AssertionError:  # the learner is being restarted
                    time.sleep(1)
                    continue
                if run["state"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
                    break
                time.sleep(1)
            assert run["state"] == "SUCCEEDED", run
            assert run["run_id"] == run_id
            deadline = time.monotonic() + 60  # endpoints.json is rewritten once it is SERVING
            while json.loads(endpoints_file.read_text())["pids"]["learner"] == [killed_pid]:
                assert time.monotonic() < deadline, "endpoints.json names the killed learner"
                time.sleep(0.5)

        plain = tmp_path / "plain"
        run_id = submit_cli(plain)
        wait_succeeded(run_id, -1)
        uninterrupted = rows(plain)

        mid_step = tmp_path / "mid_step"
        run_id = submit_cli(mid_step)
        wait_for_rows(mid_step, 2)
        time.sleep(0.1)
        killed_pid = kill_learner_pid()
        assert_killed_mid_run(mid_step)
        wait_succeeded(run_id, killed_pid)
        assert_resumed_equals_uninterrupted(uninterrupted, mid_step)

        in_write = tmp_path / "up_killed_in_write"
        run_id = submit_cli(in_write)
        deadline = time.monotonic() + 300
        while not Path(env["MARL_TEST_STALL_MARKER"]).exists():
            assert time.monotonic() < deadline, "the learner never reached step 2's checkpoint"
            time.sleep(0.1)
        wait_succeeded(run_id, kill_learner_pid())
        assert_resumed_equals_uninterrupted(uninterrupted, in_write)
    finally:
        up.send_signal(signal.SIGTERM)
        output = up.communicate(timeout=60)[0]
    assert up.returncode == 0, output
    assert output.count("marl up: restarted the learner service") == 2, output
    assert "was killed by SIGKILL" in output
