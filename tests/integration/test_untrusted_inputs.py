"""A hostile client of the Runs API and of the workers' task stream: no code, no paths and
no unbounded input from the network, and no service stopped by what it sends.

Real processes on loopback: a private Redis, a learner and a workflow worker, started as
an operator would (`marl serve` flags: `allowed_modules` holds one package of misbehaving
modules, tests/integration/hostile/; the learner's roots are two temporary directories).
No inference replica is needed: everything here is refused, or fails, before a turn.
Each refusal is asserted by its gRPC code and by what its message names; after each, the
service that refused answers its next call.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from marl.local.launcher import Cluster
from marl.models.demo import demo_model_dir
from marl.problem import Problem
from marl.protocol.v1 import learner_pb2, learner_pb2_grpc, workflow_pb2, workflow_pb2_grpc
from marl.rollout import AdapterRef, Rollout, Task
from marl.runtime import streams

HOSTILE = "tests.integration.hostile"
BOMB = (
    'a: &a ["x","x","x","x","x","x","x","x","x"]\n'
    "b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\n"
    "c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
    "d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\n"
    "e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\n"
    "f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]\n"
)
"""A YAML alias bomb of under 300 bytes: 9^6 (half a million) strings once expanded."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("untrusted")
    root = work / "out-root"
    root.mkdir()
    c = Cluster(work / "cluster", str(demo_model_dir()), inference_replicas=0,
                sandbox_replicas=0, allowed_modules=(HOSTILE,), path_roots=(str(root),))
    try:
        endpoints = c.start()
        yield {**endpoints, "root": root, "work": work, "cluster": c}
    finally:
        c.stop()


def learner(cluster: dict[str, Any]) -> learner_pb2_grpc.LearnerStub:
    return learner_pb2_grpc.LearnerStub(grpc.insecure_channel(cluster["learner"]))


def spec(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "name": "hostile", "workflow": "single", "model": {"path": "demo"},
        "lora": {"rank": 4, "alpha": 8}, "grpo": {"group_size": 2, "mini_batch_size": 1},
        "train": {"steps": 1, "problems_per_step": 1, "val_problems": 1},
        "sampling": {"max_tokens": 4}, "data": {"train": "arithmetic", "val": "arithmetic"},
    }
    return {**base, **changes}


def refused(cluster: dict[str, Any], text: str) -> str:
    """SubmitRun's INVALID_ARGUMENT message for `text`; then the learner still answers."""
    stub = learner(cluster)
    with pytest.raises(grpc.RpcError) as err:
        stub.SubmitRun(learner_pb2.SubmitRunRequest(spec_yaml=text), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    stub.ListRuns(learner_pb2.ListRunsRequest(), timeout=10)  # still serving
    assert all(p.proc.poll() is None for p in cluster["cluster"].processes)
    return str(err.value.details())


@pytest.mark.parametrize("module", ["exits_at_import", "interrupts_at_import"])
def test_a_workflow_module_that_exits_at_import_is_refused_and_the_learner_serves(
        cluster: dict[str, Any], module: str) -> None:
    message = refused(cluster, yaml.safe_dump(spec(workflow=f"{HOSTILE}.{module}:FLOW")))
    assert "field `workflow`: cannot import module" in message
    assert "SystemExit" in message or "KeyboardInterrupt" in message


def test_workflow_args_whose_validator_exits_are_refused(cluster: dict[str, Any]) -> None:
    message = refused(cluster, yaml.safe_dump(spec(
        workflow=f"{HOSTILE}.workflows:EXITS_VALIDATING_ARGS", workflow_args={"x": 1})))
    assert "field `workflow_args`" in message and "SystemExit" in message


@pytest.mark.parametrize("field, name", [
    ("workflow", "venv.__main__:X"),  # raises SystemExit when imported: never imported
    ("workflow", "os:system"),
    ("workflow", "tests.integration.hostile_not:X"),  # a prefix allows submodules only
    ("reward.function", "subprocess:run"),
])
def test_code_outside_the_allow_list_is_refused_naming_the_setting(
        cluster: dict[str, Any], field: str, name: str) -> None:
    changes = {"workflow": name} if field == "workflow" else {"reward": {"function": name}}
    message = refused(cluster, yaml.safe_dump(spec(**changes)))
    assert f"field `{field}`" in message and "is not allowed here" in message
    assert "MARL_LEARNER_ALLOWED_MODULES" in message


def test_out_dir_outside_the_roots_or_in_another_run_is_refused(
        cluster: dict[str, Any]) -> None:
    root: Path = cluster["root"]
    outside = cluster["work"] / "elsewhere"
    message = refused(cluster, yaml.safe_dump(spec(out_dir=str(outside))))
    assert "field `out_dir`" in message and "MARL_LEARNER_OUT_DIR_ROOTS" in message
    escape = root / "link"
    escape.symlink_to(outside, target_is_directory=True)  # a link out of the root
    assert "field `out_dir`" in refused(cluster, yaml.safe_dump(spec(out_dir=str(escape / "r"))))

    done = root / "finished"  # a run's directory on disk (another learner's, a forgotten run)
    done.mkdir()
    (done / "metrics.jsonl").write_text("{}\n")
    for target in (done, done / "checkpoints"):
        message = refused(cluster, yaml.safe_dump(spec(out_dir=str(target))))
        assert "another run's directory" in message

    # a queued run that has not written yet: its claim refuses. The learner trains one run
    # at a time; the first (waiting for an inference replica) keeps the second queued
    stub = learner(cluster)
    ids = [stub.SubmitRun(learner_pb2.SubmitRunRequest(
        spec_yaml=yaml.safe_dump(spec(out_dir=str(root / name)))), timeout=60).run_id
        for name in ("busy", "queued")]
    try:
        message = refused(cluster, yaml.safe_dump(spec(out_dir=str(root / "queued"))))
        state = stub.GetRun(learner_pb2.GetRunRequest(run_id=ids[1]), timeout=10).state
        assert state == "QUEUED" and not (root / "queued").exists()
        assert f"run {ids[1]} writes to" in message
    finally:
        for run_id in ids:
            stub.CancelRun(learner_pb2.CancelRunRequest(run_id=run_id), timeout=30)


def test_model_and_data_paths_outside_the_roots_are_refused(cluster: dict[str, Any]) -> None:
    message = refused(cluster, yaml.safe_dump(spec(model={"path": "/etc"})))
    assert "field `model.path`" in message and "MARL_LEARNER_MODEL_ROOTS" in message
    message = refused(cluster, yaml.safe_dump(spec(
        data={"train": "arithmetic", "val": "arithmetic", "train_path": "/etc/passwd"})))
    assert "field `data.train_path`" in message and "MARL_LEARNER_DATA_ROOTS" in message


def test_an_alias_bomb_is_refused_at_once_and_the_learner_stays_responsive(
        cluster: dict[str, Any]) -> None:
    assert len(BOMB) < 300
    started = time.monotonic()
    message = refused(cluster, BOMB)
    assert time.monotonic() - started < 1.0
    assert "anchors and aliases" in message


def test_marl_submit_refuses_an_alias_bomb_before_it_sends_anything(
        tmp_path: Path) -> None:
    """Nothing listens at the address `marl submit` is given: had it sent anything it
    would report the learner unreachable; it exits 2 naming the aliases instead."""
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(BOMB)
    done = subprocess.run([sys.executable, "-m", "marl.cli", "submit", str(bomb),
                           "--learner", "127.0.0.1:9"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "anchors and aliases" in done.stderr


def test_a_spec_over_the_size_cap_is_refused(cluster: dict[str, Any]) -> None:
    padding = "# " + "x" * 1000 + "\n"
    message = refused(cluster, yaml.safe_dump(spec()) + padding * 1100)  # > 1 MiB
    assert "MARL_LEARNER_MAX_SPEC_BYTES" in message


@pytest.mark.parametrize("judge, field", [
    ({"endpoint": "http://127.0.0.1:9/v1", "api_key_env": "MARL_AUTH_TOKEN"},
     "reward.judge.api_key_env"),
    ({"endpoint": "http://attacker.example/v1"}, "reward.judge.endpoint"),
])
def test_a_judge_that_would_leak_a_secret_is_refused(
        cluster: dict[str, Any], judge: dict[str, Any], field: str) -> None:
    message = refused(cluster, yaml.safe_dump(spec(reward={"judge": judge})))
    assert f"field `{field}`" in message


def bad_task(workflow: str, run_id: str = "hostile-run") -> Task:
    return Task(
        run_id=run_id, step=0, kind="train",
        problem=Problem(id="p", prompt="1+1?", answer="2", task="math"), sample=0,
        workflow=workflow, adapters={"generator": AdapterRef(f"{run_id}/shared", 0)},
        model_path=str(demo_model_dir()), temperature=1.0, top_p=1.0, max_tokens=4,
    )


def test_run_episode_refuses_code_outside_the_workers_allow_list(
        cluster: dict[str, Any]) -> None:
    stub = workflow_pb2_grpc.WorkflowStub(grpc.insecure_channel(cluster["workflow"][0]))
    for name, says in (("os:system", "MARL_WORKFLOW_ALLOWED_MODULES"),
                       (f"{HOSTILE}.exits_at_import:FLOW", "SystemExit")):
        task = json.dumps(bad_task(name).to_dict())
        with pytest.raises(grpc.RpcError) as err:
            stub.RunEpisode(workflow_pb2.RunEpisodeRequest(task_json=task), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "field `workflow`" in str(err.value.details()) and says in str(
            err.value.details())
    stub.GetStats(workflow_pb2.GetStatsRequest(), timeout=10)  # still serving


def test_a_task_from_redis_is_rechecked_and_its_code_cannot_stop_the_worker(
        cluster: dict[str, Any]) -> None:
    """Tasks put on the stream as if by a learner (or by anyone who can reach Redis): one
    naming code the worker does not allow, one whose workflow gathers a coroutine that
    raises SystemExit. Each comes back as a failed rollout; the worker lives on."""
    run_id = "hostile-run"
    tasks = [bad_task("os:system", run_id),
             bad_task(f"{HOSTILE}.workflows:EXITS_IN_GATHER", run_id)]
    tasks[1].sample = 1

    async def go() -> list[Rollout]:
        r = streams.connect(cluster["redis"])
        try:
            for t in tasks:
                await streams.add(r, streams.TASKS, t.to_dict())
            deadline = time.monotonic() + 120
            while True:
                entries: Any = await r.xrange(streams.rollouts_stream(run_id))
                if len(entries) >= len(tasks) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
            return [Rollout.from_dict(json.loads(fields["json"])) for _, fields in entries]
        finally:
            await r.aclose()

    rollouts = {ro.sample: ro for ro in asyncio.run(go())}
    assert set(rollouts) == {0, 1}
    assert "MARL_WORKFLOW_ALLOWED_MODULES" in (rollouts[0].error or "")
    assert "UserCodeExit" in (rollouts[1].error or "") and "SystemExit" in (
        rollouts[1].error or "")
    stub = workflow_pb2_grpc.WorkflowStub(grpc.insecure_channel(cluster["workflow"][0]))
    stats = stub.GetStats(workflow_pb2.GetStatsRequest(), timeout=10)
    assert stats.episodes_failed >= 2
    assert all(p.proc.poll() is None for p in cluster["cluster"].processes)
