"""Bring your own task, every service a process (one cluster on the demo model, the runs
one after another): a verl parquet and a verl-signature reward function, a JSONL with
other column names and a `save_to_disk` folder, a reward that raises, `workflow_args`, a
tool-using workflow, an LLM judge served by the run's own inference, and an agent using
the `openai` client's tools. Each trains 2 steps, or fails as it must."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from marl.data import arithmetic
from marl.local.launcher import Cluster
from marl.protocol.v1 import learner_pb2
from tests.support.byo import base_spec, records, rollouts, stub, train

# the replica is given the model's name, as `marl serve inference --model demo` is: it
# serves that directory, the one the runs' model.path names
pytestmark = [
    pytest.mark.slow, pytest.mark.timeout(1500), pytest.mark.cluster(model="demo"),
]

USER = "tests.integration.byo_user"


def refused(cluster: Cluster, spec: dict[str, Any]) -> str:
    with pytest.raises(grpc.RpcError) as err:
        stub(cluster).SubmitRun(learner_pb2.SubmitRunRequest(spec_yaml=yaml.safe_dump(spec)),
                                timeout=120)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return str(err.value.details())


def write_verl_parquet(path: Path, n: int = 12) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    train, _ = arithmetic.split(0)
    rows = [{"data_source": "arith", "ability": "math",
             "prompt": [{"role": "user", "content": p.prompt}],
             "reward_model": {"style": "rule", "ground_truth": p.answer},
             "extra_info": {"split": "train", "index": i}} for i, p in enumerate(train[:n])]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_verl_parquet_and_verl_reward_function_train(cluster: Cluster, tmp_path: Path) -> None:
    out = tmp_path / "run"
    data = write_verl_parquet(tmp_path / "train.parquet")
    spec = base_spec("byo-verl", out, data={"train_path": str(data), "format": "verl",
                                            "val_fraction": 0.25},
                     reward={"function": f"{USER}:compute_score"})
    run = train(cluster, spec)
    assert run.state == "SUCCEEDED", run.error
    rows = records(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:  # the function's components, logged as metrics
        assert {"train/acc", "train/has_number", "train/index_seen"} <= set(r)
        assert r["train/index_seen"] == 1.0
    assert all(ro["problem_id"].startswith("arith-") for ro in rollouts(out, 1))


def test_other_columns_and_a_datasets_folder_train(cluster: Cluster, tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    train_rows, val_rows = arithmetic.split(0)
    jsonl = tmp_path / "mine.jsonl"
    jsonl.write_text("".join(json.dumps({"question_text": p.prompt, "solution": p.answer})
                             + "\n" for p in train_rows[:12]))
    folder = tmp_path / "val_ds"
    datasets.Dataset.from_list([{"question_text": p.prompt, "solution": p.answer}
                                for p in val_rows[:4]]).save_to_disk(folder)
    out = tmp_path / "run"
    spec = base_spec("byo-columns", out, data={
        "train_path": str(jsonl), "val_path": str(folder), "prompt_key": "question_text",
        "answer_key": "solution"})
    run = train(cluster, spec)
    assert run.state == "SUCCEEDED", run.error
    rows = records(out)
    assert [r["step"] for r in rows] == [0, 1, 2] and "val/accuracy" in rows[0]
    # a bad file is refused at submit, naming the file, the row and the column
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question_text": "x", "solution": "1"}) + "\n"
                   + json.dumps({"question_text": 5, "solution": "2"}) + "\n")
    spec["data"] = {**spec["data"], "train_path": str(bad), "on_bad_row": "refuse"}
    spec["out_dir"] = str(tmp_path / "bad-run")  # the first run's directory stays its own
    assert "bad.jsonl row 2: `question_text` must be a string" in refused(cluster, spec)


def test_a_raising_reward_fails_every_rollout_and_the_run(cluster: Cluster,
                                                          tmp_path: Path) -> None:
    out = tmp_path / "run"
    spec = base_spec("byo-boom", out, reward={"function": f"{USER}:boom"},
                     train={"steps": 4})
    run = train(cluster, spec)
    assert run.state == "FAILED"
    assert "reward function tests.integration.byo_user:boom raised ValueError" in run.error
    assert run.failed_episodes == run.episodes > 0


def test_workflow_args_reach_the_workflow(cluster: Cluster, tmp_path: Path) -> None:
    out = tmp_path / "run"
    spec = base_spec("byo-args", out, workflow=f"{USER}:ROUNDS",
                     workflow_args={"rounds": 2})
    details = refused(cluster, {**spec, "workflow_args": {"rounds": 7}})
    assert "field `workflow_args.rounds`" in details
    run = train(cluster, spec)
    assert run.state == "SUCCEEDED", run.error
    assert all(r["train/rounds_seen"] == 2.0 for r in records(out)[1:])
    assert all(len(ro["turns"]) == 2 for ro in rollouts(out, 1))


def test_a_tool_using_workflow_trains(cluster: Cluster, tmp_path: Path) -> None:
    out = tmp_path / "run"
    spec = base_spec("byo-tools", out, workflow="examples.workflows.tool_agents:MATH_AGENT",
                     workflow_args={"tools": ["python", "calculator"], "max_tool_calls": 2})
    run = train(cluster, spec)
    assert run.state == "SUCCEEDED", run.error
    rows = records(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all("role/solver/tool_errors" in r for r in rows[1:])
    for ro in rollouts(out, 2):
        for t in ro["turns"]:
            assert t["role"] == "solver" and t["adapter"]["version"] == 1
            assert len(t["logprobs"]) == len(t["completion_ids"]) > 0


def test_a_judge_served_by_the_runs_own_inference_trains(cluster: Cluster,
                                                         tmp_path: Path) -> None:
    out = tmp_path / "run"
    spec = base_spec("byo-judge", out, workflow="examples.workflows.judged:WRITER",
                     reward={"judge": {"model": "base", "max_tokens": 6, "max_score": 10}})
    run = train(cluster, spec)
    assert run.state == "SUCCEEDED", run.error
    rows = records(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all("train/judge_parsed" in r for r in rows[1:])
    for ro in rollouts(out, 1):
        assert [t["role"] for t in ro["turns"]] == ["writer"]  # the judge is not trained
        (judge,) = ro["judge_turns"]
        assert judge["role"] == "judge" and judge["prompt_ids"] and judge["completion_ids"]
        assert len(judge["logprobs"]) == len(judge["completion_ids"])


def test_an_openai_agent_with_tools_trains(cluster: Cluster, tmp_path: Path) -> None:
    out = tmp_path / "run"
    spec = base_spec("byo-openai-tools", out,
                     workflow="examples.workflows.openai_tool_agent:AGENT")
    run = train(cluster, spec)
    assert run.state == "SUCCEEDED", run.error
    for step in (1, 2):
        for ro in rollouts(out, step):
            assert ro["turns"]
            for t in ro["turns"]:
                assert t["role"] == "solver"
                assert t["adapter"]["version"] == step - 1
                assert t["prompt_ids"] and len(t["logprobs"]) == len(t["completion_ids"]) > 0
