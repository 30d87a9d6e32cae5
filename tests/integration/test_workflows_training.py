"""Every built-in workflow trains 2 steps under shared and isolated routing, on math and on
code, every service a real process; a user workflow trains by being named in a spec; bad
workflow specs are refused at SubmitRun; with a real engine, parallel role turns overlap.

One cluster (a private Redis, inference on the transformers engine, a sandbox, a
workflow worker, a learner) serves every case. The full matrix is `slow`; the default
run keeps one run per new workflow.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from safetensors.torch import load_file

from marl.local.launcher import Cluster
from marl.protocol import adapter_io
from marl.protocol.v1 import inference_pb2, inference_pb2_grpc, learner_pb2, learner_pb2_grpc
from marl.rollout import AdapterRef, Task
from marl.runtime import streams
from marl.workflows import resolve

# the tiny model's warm start counts as setup
pytestmark = [pytest.mark.timeout(1800), pytest.mark.cluster(model_fixture="tiny_model_dir", sandbox_replicas=1)]

DEBATE = "examples.workflows.debate:DEBATE"
DATA = {"math": "arithmetic", "code": "humaneval"}


def spec(model_dir: Path, out: Path, workflow: str, policy: str, task: str) -> dict[str, Any]:
    return {
        "name": "it-" + workflow.rpartition(":")[2].lower(),
        "workflow": workflow,
        "policy": policy,
        "out_dir": str(out),
        "model": {"path": str(model_dir)},
        "lora": {"rank": 4, "alpha": 8},
        "optim": {"lr": 1e-2, "warmup_steps": 0},
        "grpo": {"group_size": 2},
        "train": {
            "steps": 2,
            "problems_per_step": 2,
            "val_interval": 1000,
            "val_problems": 1,
            "checkpoint_interval": 1000,
            "step_timeout_s": 180,
        },
        "sampling": {"temperature": 2.0, "max_tokens": 4},
        "data": {"train": DATA[task], "val": DATA[task]},
    }


def learner(cluster: Cluster) -> learner_pb2_grpc.LearnerStub:
    return learner_pb2_grpc.LearnerStub(grpc.insecure_channel(cluster.endpoints()["learner"]))


def train(cluster: Cluster, run_spec: dict[str, Any]) -> learner_pb2.Run:
    stub = learner(cluster)
    run_id = stub.SubmitRun(
        learner_pb2.SubmitRunRequest(spec_yaml=yaml.safe_dump(run_spec)), timeout=60).run_id
    for _ in stub.WatchRun(learner_pb2.WatchRunRequest(run_id=run_id, from_start=True),
                           timeout=800):
        pass
    return stub.GetRun(learner_pb2.GetRunRequest(run_id=run_id), timeout=10)


def expected_roles(workflow: str, turns: list[dict[str, Any]]) -> None:
    """The turn sequence each workflow produces (parallel slots in any order)."""
    roles = [(t["role"], t["slot"]) for t in turns]
    if workflow == "single":
        assert roles == [("generator", 0)]
    elif workflow == "voting":
        assert sorted(roles[:3]) == [("generator", s) for s in range(3)]
        assert roles[3:] == [("aggregator", 0)]
    elif workflow == "orch_workers":
        assert roles[0] == ("orchestrator", 0)
        assert sorted(roles[1:4]) == [("worker", s) for s in range(3)]
        assert roles[4:] == [("synthesizer", 0)]
    elif workflow == "eval_opt":
        assert roles[0] == ("generator", 0)
        rest = roles[1:]
        for k in range(0, len(rest), 2):  # evaluator k, then (if Incorrect) generator k+1
            assert rest[k] == ("evaluator", k // 2)
            if k + 1 < len(rest):
                assert rest[k + 1] == ("generator", k // 2 + 1)
        assert len(rest) <= 2 * 3
    else:
        assert sorted(roles[:2]) == sorted(roles[2:4]) == [("solver", 0), ("solver", 1)]
        assert roles[4:] == [("judge", 0)]


FACTS = {
    "single": [],
    "voting": ["majority_agreement", "oracle_pass_at_n"],
    "eval_opt": ["rounds_used", "verdict_parse_rate", "verdict_accuracy"],
    "orch_workers": ["workers_oracle_pass_at_n"],
    DEBATE: [],
}


FINISHED: list[Path] = []
"""Output directories of runs that succeeded (their adapters serve the concurrency probe)."""


def check_run(run: learner_pb2.Run, out: Path, workflow: str, policy: str) -> None:
    assert run.state == "SUCCEEDED", run.error
    FINISHED.append(out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["val/signature_problems"] == 1  # min(train.signature_problems, 1 problem)
    adapters = {"shared"} if policy == "shared" else set(resolve(workflow).roles)
    for row in rows[1:]:
        assert row["train/episode_errors"] == 0
        for fact in FACTS[workflow]:
            assert f"train/{fact}" in row
        trained = {k.split("/")[1] for k in row if k.startswith("policy/") and k.endswith("/loss")}
        assert trained == adapters, (row["step"], sorted(trained))
    for step in (1, 2):
        rollouts = [json.loads(line) for line in
                    (out / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert rollouts
        for rollout in rollouts:
            assert rollout["error"] is None
            expected_roles(workflow, rollout["turns"])
            for turn in rollout["turns"]:
                policy_name = "shared" if policy == "shared" else turn["role"]
                assert turn["adapter"] == {"name": f"{run.run_id}/{policy_name}",
                                           "version": step - 1}
                assert len(turn["logprobs"]) == len(turn["completion_ids"]) <= 4


FAST = {("eval_opt", "isolated", "math"), ("orch_workers", "isolated", "code")}
MATRIX = [
    pytest.param(w, p, t, marks=() if (w, p, t) in FAST else (pytest.mark.slow, pytest.mark.workflows),
                 id=f"{w}-{p}-{t}")
    for w in ("single", "voting", "eval_opt", "orch_workers")
    for p in ("shared", "isolated")
    for t in ("math", "code")
]


@pytest.mark.parametrize(("workflow", "policy", "task"), MATRIX)
def test_built_in_workflow_trains_two_steps(
    cluster: Cluster, tiny_model_dir: Path, tmp_path: Path, workflow: str, policy: str, task: str
) -> None:
    out = tmp_path / "run"
    run = train(cluster, spec(tiny_model_dir, out, workflow, policy, task))
    check_run(run, out, workflow, policy)


def test_debate_example_trains_two_steps_named_in_a_spec(
    cluster: Cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    run = train(cluster, spec(tiny_model_dir, out, DEBATE, "isolated", "math"))
    check_run(run, out, DEBATE, "isolated")


@pytest.mark.parametrize(
    ("workflow", "groups", "field"),
    [
        ("no_such_package.flows:DEBATE", None, "workflow"),
        ("examples.workflows.debate:MISSING", None, "workflow"),
        (DEBATE, {"solver": "a"}, "policy_groups"),
    ],
)
def test_bad_workflow_specs_are_refused_naming_the_field(
    cluster: Cluster, tiny_model_dir: Path, tmp_path: Path, workflow: str,
    groups: dict[str, str] | None, field: str,
) -> None:
    bad = spec(tiny_model_dir, tmp_path / "run", workflow, "shared", "math")
    if groups:
        bad["policy_groups"] = groups
    with pytest.raises(grpc.RpcError) as err:
        learner(cluster).SubmitRun(learner_pb2.SubmitRunRequest(spec_yaml=yaml.safe_dump(bad)),
                                   timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"field `{field}`" in err.value.details()


class Timed:
    """An inference stub that records when each Generate started and ended."""

    def __init__(self, stub: inference_pb2_grpc.InferenceStub, log: list[tuple[str, float, float]]):
        self.stub = stub
        self.log = log

    async def Generate(self, request: inference_pb2.GenerateRequest, timeout: float) -> Any:  # noqa: N802
        loop = asyncio.get_running_loop()
        started = loop.time()
        resp = await self.stub.Generate(request, timeout=timeout)
        role_slot = ":".join(request.request_id.rsplit(":", 3)[1:3])
        self.log.append((role_slot, started, loop.time()))
        return resp


@pytest.mark.parametrize(("workflow", "parallel_role"), [("voting", "generator"),
                                                         ("orch_workers", "worker")])
def test_parallel_turns_are_in_flight_together_on_a_real_engine(
    cluster: Cluster, tiny_model_dir: Path, workflow: str, parallel_role: str
) -> None:
    from services.workflow.worker import EpisodeRunner

    endpoints = cluster.endpoints()
    stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(endpoints["inference"][0]))
    info = stub.GetInfo(inference_pb2.GetInfoRequest(), timeout=10)
    if not FINISHED:  # no run has finished in this session yet: train one
        out = Path(cluster.workdir) / "seed-run"
        check_run(train(cluster, spec(tiny_model_dir, out, "single", "shared", "math")), out,
                  "single", "shared")
    adapter = next(FINISHED[0].rglob("adapter_*.safetensors"))
    state = load_file(str(adapter))
    modules = sorted({k.split(".")[-3] for k in state})
    payload = adapter_io.serialize(state)
    manifest = adapter_io.make_manifest(f"probe-{workflow}/p", 0, info.base_model, 4, 8.0,
                                        modules, payload)
    stub.PushAdapter(adapter_io.chunks(manifest, payload), timeout=60)

    from marl.data import arithmetic

    problem = arithmetic.split(0)[1][0]
    task = Task(run_id=f"probe-{workflow}", step=0, kind="val", problem=problem, sample=0,
                workflow=workflow,
                adapters={r: AdapterRef(f"probe-{workflow}/p", 0)
                          for r in resolve(workflow).roles},
                model_path=str(tiny_model_dir), temperature=1.0, top_p=1.0, max_tokens=24)
    log: list[tuple[str, float, float]] = []

    async def episode() -> Any:
        r = streams.connect(endpoints["redis"])
        runner = EpisodeRunner(r, "probe", replica_wait_s=0, judge_endpoints=())
        real = runner.stubs

        async def timed(fresh: bool = False) -> list[Any]:
            return [Timed(s, log) for s in await real(fresh)]

        runner.stubs = timed  # type: ignore[method-assign]
        try:
            return await runner.run(task)
        finally:
            await runner.close()
            await r.aclose()

    rollout = asyncio.run(episode())
    assert rollout.error is None
    parallel = [(s, e) for name, s, e in log if name.startswith(parallel_role)]
    assert len(parallel) == 3
    # every parallel turn started before any of them finished
    assert max(s for s, _ in parallel) < min(e for _, e in parallel)


def marl_episode(tmp_path: Path, run_spec: dict[str, Any], *args: str) -> Any:
    import subprocess
    import sys

    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(run_spec))
    return subprocess.run([sys.executable, "-m", "marl.cli", "episode", str(path), *args],
                          capture_output=True, text=True, timeout=600)


def test_marl_episode_prints_one_transcript_from_a_checkpoint(
    cluster: Cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`marl episode` on the running cluster: every turn with its role, slot, adapter@version,
    token counts and finish reason, then the final answer and reward; a bad problem index is
    a user error (exit 2) naming the flag."""
    cluster.write_endpoints(tmp_path / "endpoints.json")
    out = tmp_path / "run"
    run_spec = spec(tiny_model_dir, out, "orch_workers", "isolated", "math")
    run_spec["train"]["steps"] = 1
    run_spec["train"]["checkpoint_interval"] = 1
    trained = train(cluster, run_spec)
    assert trained.state == "SUCCEEDED", trained.error

    done = marl_episode(tmp_path, run_spec, "--problem", "1", "--checkpoint", str(out),
                        "--endpoints", str(tmp_path))
    assert done.returncode == 0, done.stderr
    text = done.stdout
    blocks = [line for line in text.splitlines() if line.startswith("[")]
    names = [b.split()[1] for b in blocks]
    assert names[0] == "orchestrator[0]" and names[4:] == ["synthesizer[0]"]
    assert sorted(names[1:4]) == ["worker[0]", "worker[1]", "worker[2]"]
    for block in blocks:
        role = block.split()[1].split("[")[0]
        assert f"/{role}@0  " in block  # the checkpoint's adapter of that role, pushed as v0
        assert "completion" in block and "finish" in block
    assert "final answer:" in text and "reward: " in text
    assert "fact workers_oracle_pass_at_n: " in text

    as_json = marl_episode(tmp_path, run_spec, "--problem", "1", "--checkpoint", str(out),
                           "--endpoints", str(tmp_path), "--json")
    rollout = json.loads(as_json.stdout)
    assert rollout["error"] is None and len(rollout["turns"]) == 5
    # the same task twice: same per-turn seeds, so the same tokens on the same engine (the
    # turns served alone; the workers' batch may be padded differently from run to run)
    again = json.loads(marl_episode(tmp_path, run_spec, "--problem", "1", "--checkpoint",
                                    str(out), "--endpoints", str(tmp_path), "--json").stdout)
    for i in (0, 4):
        assert again["turns"][i]["completion_ids"] == rollout["turns"][i]["completion_ids"]

    # no checkpoint: adapters equal to the base model, one per policy
    base = marl_episode(tmp_path, run_spec, "--problem", "0", "--endpoints", str(tmp_path),
                        "--json")
    assert base.returncode == 0, base.stderr
    turns = json.loads(base.stdout)["turns"]
    assert {t["adapter"]["name"].split("/")[1] for t in turns} == {
        "orchestrator", "worker", "synthesizer"}

    bad = marl_episode(tmp_path, run_spec, "--problem", "100000", "--endpoints", str(tmp_path))
    assert bad.returncode == 2 and "--problem 100000" in bad.stderr, bad.stderr
