"""`marl matrix`: expansion into cells and controls, the done/resume rule, and Table 1's
numbers (peak, residual against SA-RL, cliff depth, step of the peak) on hand-made runs."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest

from marl.experiments import matrix
from marl.experiments import matrix_tables as tables
from marl.experiments.evaluate import checkpoint_dir, parse_routing
from marl.experiments.matrix_report import write_report
from marl.spec.run import SpecError

MODEL = "/models/m"


def _matrix(**axes: Any) -> dict[str, Any]:
    return {
        "name": "t",
        "base": {"model": {"path": MODEL}, "train": {"steps": 3},
                 "data": {"train": "arithmetic", "val": "arithmetic"}},
        "axes": {"workflow": ["voting"], "policy": ["shared", "isolated"], **axes},
    }


def _write(root: Path, cell: matrix.Cell, accs: list[float | None], done: bool = True,
           alarms: dict[int, list[str]] | None = None) -> None:
    d = matrix.cell_dir(root, cell)
    d.mkdir(parents=True, exist_ok=True)
    rows = []
    for step, acc in enumerate(accs):
        row: dict[str, Any] = {"step": step, "alarms": (alarms or {}).get(step, [])}
        if acc is not None:
            row["val/accuracy"] = acc
        rows.append(row)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if done:
        matrix._mark(root, cell, "SUCCEEDED")


def test_expansion_adds_both_controls_per_task_model_seed() -> None:
    m = matrix.load_matrix(_matrix(seed=[0, 1]))
    names = [c.name for c in m.cells]
    assert names == [
        "arithmetic-m-s0-base", "arithmetic-m-s0-sa_rl", "arithmetic-m-s0-voting-shared",
        "arithmetic-m-s0-voting-isolated", "arithmetic-m-s1-base", "arithmetic-m-s1-sa_rl",
        "arithmetic-m-s1-voting-shared", "arithmetic-m-s1-voting-isolated",
    ]
    by_name = {c.name: c for c in m.cells}
    sa = next(c for c in m.cells if c.kind == "sa_rl" and c.seed == 1)
    assert sa.spec.workflow == "single" and sa.spec.train.steps == 3 and sa.spec.seed == 1
    assert sa.spec.model.path == MODEL
    assert len(by_name) == len(names)


def test_task_axis_sets_both_splits() -> None:
    m = matrix.load_matrix(_matrix(task=["arithmetic", "champ"]))
    champ = [c for c in m.cells if c.task == "champ"]
    assert len(champ) == 4
    assert all(c.spec.data.train == c.spec.data.val == "champ" for c in champ)


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"axes": {"lr": [1]}}, "axes"),
        ({"axes": {"workflow": []}}, "axes.workflow"),
        ({"controls": {"oracle": True}}, "controls"),
        ({"bogus": 1}, "unknown field"),
        ({"axes": {"workflow": ["nope"]}}, "workflow"),
    ],
)
def test_bad_matrix_names_the_field(raw: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError, match=field):
        matrix.load_matrix({"base": {"model": {"path": MODEL}}, **raw})


def test_curve_peak_step_final_and_cliff() -> None:
    rows = [
        {"step": 0, "val/accuracy": 0.125, "alarms": []},
        {"step": 1, "alarms": ["sp_role_capture"]},
        {"step": 2, "val/accuracy": 0.5, "alarms": []},
        {"step": 3, "val/accuracy": 0.5, "alarms": []},
        {"step": 4, "val/accuracy": 0.25, "alarms": [], "guard": "rollback to step 2"},
    ]
    c = tables.curve(rows)
    assert c is not None
    assert c.steps == [0, 2, 3, 4]
    assert c.peak == 0.5 and c.peak_step == 2  # the first step at the peak
    assert c.final == 0.25 and c.cliff == -0.25
    assert c.alarms == ["step 1: sp_role_capture", "step 4: guard rollback to step 2"]
    assert tables.curve([{"step": 0}]) is None


def test_curve_takes_the_last_value_of_a_step_logged_twice() -> None:
    rows = [{"step": 0, "val/accuracy": 0.25}, {"step": 1, "val/accuracy": 0.75},
            {"step": 1, "val/accuracy": 0.5}]
    c = tables.curve(rows)
    assert c is not None and c.peak == 0.5 and c.peak_step == 1 and c.cliff == 0.0


def test_table_residuals_and_cliffs_from_the_cells(tmp_path: Path) -> None:
    m = matrix.load_matrix(_matrix())
    cells = {c.kind if c.kind != "run" else c.policy: c for c in m.cells}
    matrix.prepare(tmp_path, m)
    _write(tmp_path, cells["base"], [0.125])
    _write(tmp_path, cells["sa_rl"], [0.125, 0.375, 0.25])
    _write(tmp_path, cells["isolated"], [0.125, 0.5, 0.375, 0.5], alarms={2: ["ip_drift"]})
    _write(tmp_path, cells["shared"], [0.125, 0.25, 0.75, 0.0])
    rows = tables.table_rows(matrix.load_curves(tmp_path, m))
    assert len(rows) == 1
    row = rows[0]
    assert row["workflow"] == "voting" and row["base"] == 0.125 and row["sa_rl"] == 0.375
    assert row["ip_peak"] == 0.5 and row["ip_residual"] == 0.125
    assert row["ip_final"] == 0.5 and row["ip_cliff"] == 0.0 and row["ip_peak_step"] == 1
    assert row["ip_alarms"] == ["step 2: ip_drift"]
    assert row["sp_peak"] == 0.75 and row["sp_residual"] == 0.375
    assert row["sp_final"] == 0.0 and row["sp_cliff"] == -0.75 and row["sp_peak_step"] == 2
    assert row["sp_alarms"] == []

    paths = write_report(tmp_path)
    with paths["csv"].open() as f:
        got = list(csv.DictReader(f))
    assert len(got) == 1
    assert float(got[0]["ip_residual"]) == 0.125 and float(got[0]["sp_cliff"]) == -0.75
    assert got[0]["sp_peak_step"] == "2" and got[0]["ip_alarms"] == "step 2: ip_drift"
    md = paths["markdown"].read_text()
    assert f"| arithmetic | {MODEL} | 0 | voting | 0.125 | 0.375 | 0.500 | 0.750 | +0.125 | " \
        "+0.375 | 0.500 | 0.000 | 0.000 | -0.750 | 1 | 2 | sampled T=0.7 | 1: step 2: ip_drift | 0 |" in md
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"


def test_missing_cells_leave_blanks_and_are_not_done(tmp_path: Path) -> None:
    m = matrix.load_matrix(_matrix())
    cells = {c.kind if c.kind != "run" else c.policy: c for c in m.cells}
    matrix.prepare(tmp_path, m)
    _write(tmp_path, cells["shared"], [0.25, 0.5])
    _write(tmp_path, cells["isolated"], [0.25], done=False)  # killed mid-run
    assert matrix.cell_done(tmp_path, cells["shared"])
    assert not matrix.cell_done(tmp_path, cells["isolated"])
    row = tables.table_rows(matrix.load_curves(tmp_path, m))[0]
    assert row["sp_peak"] == 0.5 and row["sp_residual"] is None and row["sa_rl"] is None
    assert row["ip_peak"] is None
    status = dict(line.split(None, 1) for line in matrix.status_lines(tmp_path, m))
    assert status[cells["shared"].name].startswith("done")
    assert status[cells["isolated"].name].startswith("partial")
    assert status[cells["base"].name].startswith("pending")


def test_a_directory_holding_another_matrix_is_refused(tmp_path: Path) -> None:
    matrix.prepare(tmp_path, matrix.load_matrix(_matrix()))
    matrix.prepare(tmp_path, matrix.load_matrix(_matrix()))  # the same one resumes
    with pytest.raises(SpecError, match="another matrix"):
        matrix.prepare(tmp_path, matrix.load_matrix(_matrix(seed=[3])))


def _run_dir(tmp_path: Path, adapters: list[str]) -> Path:
    run = tmp_path / "run"
    for name in ("step_000002", "best"):
        for a in adapters:
            (run / "checkpoints" / name / "adapters" / a).mkdir(parents=True)
        (run / "checkpoints" / name / "state.json").write_text(json.dumps({"step": 2}))
    (run / "checkpoints" / "latest").write_text("step_000002")
    return run


def test_routing_resolves_checkpoints_and_policies(tmp_path: Path) -> None:
    run = _run_dir(tmp_path, ["generator", "aggregator"])
    assert checkpoint_dir(run, "latest").name == "step_000002"
    assert checkpoint_dir(run, "2") == checkpoint_dir(run, "step_2") == run / "checkpoints" / (
        "step_000002")
    routing = parse_routing(f"generator={run}@best", ["generator", "aggregator"])
    assert routing["generator"].policy == "generator" and routing["generator"].step == 2
    assert routing["aggregator"].ckpt is None  # not named: the base model
    every = parse_routing(f"*={run}@latest:aggregator", ["generator", "aggregator"])
    assert {s.policy for s in every.values()} == {"aggregator"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("judge=base", "no role 'judge'"),
        ("generator", "not ROLE="),
        ("generator={run}@step_9", "no checkpoint 'step_000009'"),
        ("generator={run}@best:nope", "no adapter 'nope'"),
        ("generator=somewhere", "RUN_DIR@CHECKPOINT"),
    ],
)
def test_bad_routing_names_what_to_fix(tmp_path: Path, text: str, message: str) -> None:
    run = _run_dir(tmp_path, ["generator", "aggregator"])
    with pytest.raises(SpecError, match=message):
        parse_routing(text.format(run=run), ["generator", "aggregator"])


def test_isolated_run_needs_the_policy_named_for_another_role(tmp_path: Path) -> None:
    run = _run_dir(tmp_path, ["generator", "aggregator"])
    with pytest.raises(SpecError, match="name one"):
        parse_routing(f"worker={run}@best", ["worker"])


def test_eval_against_an_unreachable_redis_is_a_user_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from marl.cli.main import main
    from marl.models.demo import demo_model_dir
    from marl.runtime.processes import free_port
    from marl.spec.run import dump_spec, parse_spec

    run = tmp_path / "run"
    run.mkdir()
    spec = parse_spec({"workflow": "single", "model": {"path": str(demo_model_dir())}})
    (run / "run.yaml").write_text(dump_spec(spec))
    url = f"redis://127.0.0.1:{free_port()}/0"
    assert main(["eval", str(run), "--adapters", "", "--redis", url]) == 2
    err = capsys.readouterr().err
    assert f"--redis {url}: cannot connect" in err and "Traceback" not in err


def test_the_example_matrix_expands() -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "matrix_demo.yaml"
    m = matrix.load_matrix(example)
    assert [c.kind for c in m.cells] == ["base", "sa_rl", "run", "run", "run", "run"]
    assert {(c.workflow, c.policy) for c in m.cells if c.kind == "run"} == {
        ("voting", "shared"), ("voting", "isolated"), ("eval_opt", "shared"),
        ("eval_opt", "isolated")}
