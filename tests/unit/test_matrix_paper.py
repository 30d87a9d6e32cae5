"""The paper's matrix as shipped (examples/paper/matrix.yaml) and `marl matrix --dry-run`."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from marl.experiments import matrix
from marl.experiments.estimate import gpu_hours, parameters, turns_per_episode
from marl.spec.run import RunSpec, parse_spec

PAPER = Path(__file__).resolve().parents[2] / "examples" / "paper" / "matrix.yaml"
WORKFLOWS, POLICIES = ("eval_opt", "voting", "orch_workers"), ("shared", "isolated")
TASKS, MODELS = ("math", "code"), ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b")


def test_the_paper_matrix_is_its_36_cells_and_controls_at_table_7s_settings() -> None:
    m = matrix.load_matrix(PAPER)
    runs = [c for c in m.cells if c.kind == "run"]
    assert sorted((c.task, c.model, c.workflow, c.policy) for c in runs) == sorted(
        itertools.product(TASKS, MODELS, WORKFLOWS, POLICIES))
    for kind in ("base", "sa_rl"):
        assert sorted((c.task, c.model) for c in m.cells if c.kind == kind) == sorted(
            itertools.product(TASKS, MODELS))
    for c in m.cells:
        s = c.spec
        assert s.model.chat_template_kwargs == {"enable_thinking": False}  # set, not implied
        assert (s.lora.rank, s.lora.alpha, s.optim.lr, s.optim.warmup_steps) == (64, 32, 2e-5, 15)
        assert (s.grpo.group_size, s.grpo.mini_batch_size, s.train.problems_per_step) == (8, 64, 64)
        assert (s.train.steps, s.train.val_interval, s.train.checkpoint_interval) == (500, 10, 5)
        assert s.sampling.temperature == 0.7 and s.sampling.val_temperature is None
        assert s.train.signature_problems == 100
        if c.task == "math":
            assert (s.data.train, s.data.val_size, s.data.val_subset) == ("dapo_math", 1412, None)
        else:
            assert (s.data.train, s.data.val_size, s.data.val_subset) == (
                "deepcoder", 1000, "primeintellect")


def test_dry_run_lists_every_cell_with_an_estimate_and_trains_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from marl.cli.main import main

    monkeypatch.chdir(tmp_path)
    assert main(["matrix", str(PAPER), "--dry-run"]) == 0
    out = capsys.readouterr().out
    m = matrix.load_matrix(PAPER)
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:] if line.strip()}
    for c in m.cells:
        row = rows[c.name]
        assert row[1] == c.kind and row[-2] == "off"
        assert row[-1] == "<0.01" or float(row[-1]) > 0  # every cell has an estimate
    assert "36 trained cells, 6 base-model and 6 single-agent RL controls" in out
    assert list(tmp_path.iterdir()) == []  # no matrix directory, nothing run


def test_the_estimate_counts_turns_and_scale() -> None:
    def spec(workflow: str, path: str) -> RunSpec:
        return parse_spec({"workflow": workflow, "model": {"path": path}})

    small, large = spec("voting", "/m/Qwen3-0.6B"), spec("voting", "/m/Qwen3-4B")
    assert parameters(small) == 0.6e9 and parameters(large) == 4e9
    assert [turns_per_episode(spec(w, "/m/Qwen3-4B")) for w in
            ("single", "voting", "orch_workers", "eval_opt")] == [1, 4, 5, 7]
    one, four = gpu_hours(spec("single", "/m/Qwen3-4B")), gpu_hours(large)
    assert one is not None and four is not None
    assert four == pytest.approx(4 * one)  # four turns an episode, each as long
    assert gpu_hours(spec("voting", "/m/unknown")) is None
