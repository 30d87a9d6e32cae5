"""`marl episode`: the task it builds, the transcript it prints, and the user errors it
names before touching a cluster (the run against a real cluster is in
tests/integration/test_workflows_training.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from marl.cli import main as cli
from marl.cli.episode import checkpoint_dir, load_checkpoint, make_task, pick_problem, render
from marl.data import arithmetic
from marl.rollout import AdapterRef, Rollout, Turn
from marl.spec.run import RunSpec, SpecError


def test_the_task_carries_what_the_spec_says_about_sampling_caps_and_templates() -> None:
    spec = RunSpec(
        workflow="eval_opt", seed=7,
        model={"chat_template_kwargs": {"enable_thinking": False}},  # type: ignore[arg-type]
        sampling={"temperature": 0.5, "val_temperature": 0.0, "max_tokens": 9},  # type: ignore[arg-type]
        caps={"eval_opt_rounds_math": 1},  # type: ignore[arg-type]
    )
    problem = arithmetic.problem(2, 3)
    refs = {"generator": AdapterRef("e/g", 0), "evaluator": AdapterRef("e/e", 0)}
    train = make_task(spec, "e", problem, refs, "train", 3)
    assert (train.temperature, train.max_tokens, train.seed, train.sample) == (0.5, 9, 7, 3)
    assert train.chat_template_kwargs == {"enable_thinking": False}
    assert train.caps["eval_opt_rounds_math"] == 1
    assert make_task(spec, "e", problem, refs, "val", 0).temperature == 0.0
    plain = spec.model_copy(update={"model": spec.model.model_copy(update={"chat_template": False})})
    assert make_task(plain, "e", problem, refs, "train", 0).chat_template is False


def test_the_transcript_names_role_slot_adapter_tokens_finish_and_reward() -> None:
    problem = arithmetic.problem(2, 3)
    turn = Turn("worker", 2, [1, 2, 3], [4, 5], [-0.1, -0.2], "length",
                AdapterRef("episode-1/worker", 0), "five")
    rollout = Rollout("t", "episode-1", 0, "train", problem.id, 0, [turn],
                      "\\boxed{5}", 1.0, facts={"workers_oracle_pass_at_n": 1.0})
    text = render(rollout, problem)
    assert "[0] worker[2]  episode-1/worker@0  prompt 3 tok, completion 2 tok, finish length" in text
    assert "    five" in text and "reward: 1" in text
    assert "fact workers_oracle_pass_at_n: 1" in text
    failed = Rollout("t", "r", 0, "train", problem.id, 0, [], "", 0.0, error="NoReplica: none")
    assert "episode FAILED (left out of training): NoReplica: none" in render(failed, problem)


def test_a_checkpoint_is_found_from_the_run_dir_and_its_adapters_read(tmp_path: Path) -> None:
    step = tmp_path / "run" / "checkpoints" / "step_000002"
    folder = step / "adapters" / "generator"
    folder.mkdir(parents=True)
    save_file({"a.lora_A.weight": torch.ones(2, 3)}, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(
        json.dumps({"r": 2, "lora_alpha": 4.0, "target_modules": ["v_proj", "q_proj"]}))
    (step.parent / "latest").write_text("step_000002")
    assert checkpoint_dir(str(tmp_path / "run")) == step
    assert checkpoint_dir(str(step)) == step
    got = load_checkpoint(str(tmp_path / "run"), ["generator"])["generator"]
    assert (got.rank, got.alpha, got.target_modules) == (2, 4.0, ["q_proj", "v_proj"])
    with pytest.raises(SpecError, match="no adapter for policy 'shared' .*has generator"):
        load_checkpoint(str(step), ["shared"])
    with pytest.raises(SpecError, match="--checkpoint"):
        checkpoint_dir(str(tmp_path))


def test_a_problem_index_out_of_range_names_the_flag() -> None:
    spec = RunSpec(data={"train": "arithmetic", "val": "arithmetic"})  # type: ignore[arg-type]
    assert pick_problem(spec, 0, "train").task == "math"
    with pytest.raises(SpecError, match=r"--problem 99999: the train split of arithmetic"):
        pick_problem(spec, 99999, "train")


def test_user_errors_exit_2_before_any_cluster_is_needed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text("workflow: orch_workers\ndata: {train: arithmetic, val: arithmetic}\n")
    # no cluster at that directory
    assert cli.main(["episode", str(spec), "--problem", "0", "--endpoints", str(tmp_path)]) == 2
    assert "no endpoints.json" in capsys.readouterr().err
    # the spec's workflow is checked first, naming the field
    assert cli.main(["episode", str(spec), "workflow=nope.mod:X", "--problem", "0"]) == 2
    assert "field `workflow`" in capsys.readouterr().err


def test_without_a_checkpoint_every_policy_gets_a_base_model_adapter() -> None:
    """B = 0: the pushed adapter changes nothing (the learner's version 0)."""
    from marl.cli.episode import base_adapters

    demo_model = Path(__file__).parents[2] / "marl" / "assets" / "demo-model"
    spec = RunSpec(model={"path": str(demo_model)}, lora={"rank": 4, "alpha": 8})  # type: ignore[arg-type]
    got = base_adapters(spec, ["orchestrator", "worker"])
    assert set(got) == {"orchestrator", "worker"}
    adapter = got["worker"]
    assert (adapter.rank, adapter.alpha) == (4, 8.0)
    assert any(m.endswith("q_proj") for m in adapter.target_modules)  # as the learner sends them
    b = [v for k, v in adapter.state.items() if "lora_B" in k]
    assert b and all(int(t.count_nonzero()) == 0 for t in b)
    assert any(int(v.count_nonzero()) > 0 for k, v in adapter.state.items() if "lora_A" in k)
