"""`marl matrix report`: Tables 1-6 and Fig. 5's statistics on hand-made metrics records with
hand-worked numbers, the axes that take mappings, and the report directory's files."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest

from marl.experiments import matrix
from marl.experiments import matrix_tables as tables
from marl.experiments.matrix_report import write_report
from marl.experiments.matrix_tables import CellRun
from marl.spec.run import SpecError

MODEL = "/models/m"


def _raw(**axes: Any) -> dict[str, Any]:
    return {
        "name": "t",
        "base": {"model": {"path": MODEL}, "train": {"steps": 3},
                 "data": {"train": "arithmetic", "val": "arithmetic"}},
        "axes": {"workflow": ["voting"], "policy": ["shared", "isolated"], **axes},
    }  # fmt: skip


def _cells(raw: dict[str, Any] | None = None) -> dict[str, matrix.Cell]:
    m = matrix.load_matrix(raw or _raw())
    return {c.kind if c.kind != "run" else f"{c.workflow}-{c.policy}": c for c in m.cells}


def _vals(accs: dict[int, float], **more: Any) -> list[dict[str, Any]]:
    return [{"step": s, "val/accuracy": a, "alarms": [], **more} for s, a in accs.items()]


# ---------------------------------------------------------------- Table 1


def test_table1_says_how_each_cell_validated() -> None:
    raw = _raw()
    raw["base"]["sampling"] = {"temperature": 0.7}
    sampled = _cells(raw)
    raw["base"]["sampling"] = {"temperature": 0.7, "val_temperature": 0}
    greedy = _cells(raw)
    curve = _vals({0: 0.2, 1: 0.5})
    rows = tables.table1([CellRun.of(sampled["voting-shared"], curve),
                          CellRun.of(greedy["voting-shared"], curve)])
    assert [r["val_decoding"] for r in rows] == ["sampled T=0.7", "greedy"]
    wide = tables.table_rows({sampled["voting-shared"]: tables.curve(curve),
                              sampled["voting-isolated"]: tables.curve(curve)})
    assert [r["val_decoding"] for r in wide] == ["sampled T=0.7"]


def test_table1_base_peak_final_deltas_cliff_and_sa_rl_residual() -> None:
    cells = _cells()
    runs = [
        CellRun.of(cells["base"], _vals({0: 0.25})),
        CellRun.of(cells["sa_rl"], _vals({0: 0.25, 1: 0.3, 2: 0.4, 3: 0.35})),
        # peak 0.6 at step 2, final 0.45: 0.15 below the peak, over cliff_drop 0.1
        CellRun.of(cells["voting-shared"], _vals({0: 0.2, 1: 0.5, 2: 0.6, 3: 0.45})),
        # step 0 is Base, never the peak: peak 0.5 (first at step 1), below Base
        CellRun.of(cells["voting-isolated"], _vals({0: 0.9, 1: 0.5, 2: 0.5, 3: 0.4})),
    ]
    rows = {r["policy"]: r for r in tables.table1(runs)}
    assert list(rows) == ["base_model", "sa_rl", "shared", "isolated"]
    sp, ip, sa = rows["shared"], rows["isolated"], rows["sa_rl"]
    assert (sp["base"], sp["peak"], sp["peak_step"], sp["final"]) == (0.2, 0.6, 2, 0.45)
    assert sp["delta_peak"] == pytest.approx(0.4) and sp["delta_final"] == pytest.approx(0.25)
    assert sp["cliff"] == 1 and sp["cliff_drop"] == 0.1
    assert sp["vs_sa_rl"] == pytest.approx(0.6 - 0.4)
    assert (ip["base"], ip["peak"], ip["peak_step"], ip["final"]) == (0.9, 0.5, 1, 0.4)
    assert ip["delta_peak"] == pytest.approx(-0.4) and ip["delta_final"] == pytest.approx(-0.5)
    assert ip["cliff"] == 1  # 0.5 - 0.4 is 0.09999999999999998: the threshold has slack
    assert (sa["peak"], sa["peak_step"], sa["final"], sa["cliff"]) == (0.4, 2, 0.35, 0)
    assert sa["vs_sa_rl"] is None and sa["workflow"] == "single"
    base = rows["base_model"]
    assert base["base"] == 0.25 and base["peak"] is None and base["cliff"] is None
    assert sp["cell"] == cells["voting-shared"].name and sp["task"] == "arithmetic"


def test_table1_a_cell_that_never_trained_has_only_its_base() -> None:
    cells = _cells()
    row = tables.table1([CellRun.of(cells["voting-shared"], _vals({0: 0.3}))])[0]
    assert row["base"] == 0.3
    assert [row[k] for k in ("peak", "final", "delta_peak", "cliff", "vs_sa_rl")] == [None] * 5


def test_table1_uses_the_last_record_of_a_step_logged_twice_and_lists_alarms() -> None:
    cells = _cells()
    rows = _vals({0: 0.1, 1: 0.7}) + [
        {"step": 1, "val/accuracy": 0.3, "alarms": ["accuracy_cliff"]},
        {"step": 2, "alarms": [], "guard": "rollback to step 1"},
    ]
    row = tables.table1([CellRun.of(cells["voting-shared"], rows)])[0]
    assert row["peak"] == 0.3 and row["final"] == 0.3
    assert row["alarms"] == ["step 1: accuracy_cliff", "step 2: guard rollback to step 1"]


# ---------------------------------------------------------------- Table 2


def _train(step: int, **metrics: float) -> dict[str, Any]:
    return {"step": step, "alarms": [], **metrics}


def test_table2_peak_over_first_per_role_and_the_shared_row() -> None:
    cells = _cells()
    g, a, s = "role/generator/", "role/aggregator/", "policy/shared/"
    records = [
        _train(0, **{g + "chi2_token": 0.5, g + "training_ppl": 1.25, g + "grad_norm": 0.2,
                     a + "chi2_token": 0.0, a + "training_ppl": 2.0, a + "grad_norm": 1.0,
                     s + "chi2_token": 0.25, s + "training_ppl": 1.5, s + "grad_norm": 0.5,
                     g + "update_chi2": 0.01}),
        _train(1, **{g + "chi2_token": 2.0, g + "training_ppl": 1.5, g + "grad_norm": 0.1,
                     a + "chi2_token": 0.3, a + "training_ppl": 1.0, a + "grad_norm": 0.5,
                     s + "chi2_token": 1.0, s + "training_ppl": 3.0, s + "grad_norm": 0.5,
                     g + "update_chi2": 0.05}),
        _train(2, **{g + "chi2_token": 1.0, g + "training_ppl": 2.5, g + "grad_norm": 0.3,
                     a + "chi2_token": 0.1, a + "training_ppl": 1.5, a + "grad_norm": 0.25,
                     s + "chi2_token": 0.75, s + "training_ppl": 1.5, s + "grad_norm": 2.0,
                     g + "update_chi2": 0.02}),
    ]  # fmt: skip
    rows = tables.table2([CellRun.of(cells["voting-shared"], records)])
    by = {r["role"]: r for r in rows}
    assert list(by) == ["generator", "aggregator", "shared"]
    assert by["generator"]["chi2_peak_over_first"] == 4.0  # 2.0 / 0.5
    assert by["generator"]["chi2_peak_step"] == 1
    assert by["generator"]["ppl_peak_over_first"] == 2.0  # 2.5 / 1.25
    assert by["generator"]["grad_norm_peak_over_first"] == pytest.approx(1.5)  # 0.3 / 0.2
    assert by["aggregator"]["chi2_peak_over_first"] is None  # first value 0: no ratio
    assert by["aggregator"]["chi2_peak_step"] == 1
    assert by["aggregator"]["ppl_peak_over_first"] == 1.0  # the first value is the peak
    assert by["shared"]["chi2_peak_over_first"] == 4.0 and by["shared"]["chi2_peak_step"] == 1
    assert by["shared"]["ppl_peak_over_first"] == 2.0
    assert by["shared"]["grad_norm_peak_over_first"] == 4.0
    assert {r["chi2_metric"] for r in rows} == {"chi2_token"}
    upd = {r["role"]: r for r in tables.table2([CellRun.of(cells["voting-shared"], records)],
                                                "update_chi2")}  # fmt: skip
    assert upd["generator"]["chi2_peak_over_first"] == pytest.approx(5.0)  # 0.05 / 0.01
    assert upd["aggregator"]["chi2_peak_over_first"] is None  # not logged: blank


FLOAT32 = {  # a Voting-SP demo cell: learner and sampler compute the same float32 logits
    0: {"chi2_token": 3e-9, "update_chi2": 0.004},
    1: {"chi2_token": -2e-8, "update_chi2": 0.010},
    2: {"chi2_token": 9.6e-8, "update_chi2": 0.006},
}


def _float32_records(**extra: dict[str, float]) -> list[dict[str, Any]]:
    out = []
    for step, m in FLOAT32.items():
        r = {f"{p}{k}": v for p in ("role/generator/", "role/aggregator/", "policy/shared/")
             for k, v in m.items()}
        r.update(extra.get(str(step), {}))
        out.append(_train(step, **r))
    return out


def test_table2_reads_update_chi2_where_chi2_token_is_rounding_noise_and_says_so() -> None:
    run = CellRun.of(_cells()["voting-shared"], _float32_records())
    auto = {r["role"]: r for r in tables.table2([run])}
    assert {r["chi2_metric"] for r in auto.values()} == {"update_chi2"}
    assert auto["generator"]["chi2_peak_over_first"] == pytest.approx(2.5)  # 0.010 / 0.004
    assert auto["generator"]["chi2_peak_step"] == 1
    # asked for by name, the noise gets no ratio (96e-8 / 3e-9 would print 32x)
    named = tables.table2([run], "chi2_token")
    assert {(r["chi2_metric"], r["chi2_peak_over_first"], r["chi2_peak_step"])
            for r in named} == {(tables.NOISE, None, None)}
    assert tables.instability(run)["max_chi2"] == pytest.approx(0.010)
    assert tables.instability(run, "chi2_token")["max_chi2"] is None
    # one value out of the floor (a bf16 sampler, another engine): chi2_token is a signal
    moved = CellRun.of(_cells()["voting-shared"],
                       _float32_records(**{"2": {"role/generator/chi2_token": 0.003}}))
    rows = {r["role"]: r for r in tables.table2([moved])}
    assert {r["chi2_metric"] for r in rows.values()} == {"chi2_token"}
    assert rows["generator"]["chi2_peak_over_first"] == pytest.approx(1e6)  # 0.003 / 3e-9


def test_table2_isolated_has_no_shared_row_and_reads_pre_rename_names() -> None:
    cells = _cells()
    g = "role/generator/"
    records = [_train(0, **{g + "perplexity": 2.0, g + "chi2": 0.1}),
               _train(1, **{g + "perplexity": 3.0, g + "chi2": 0.4})]  # fmt: skip
    rows = tables.table2([CellRun.of(cells["voting-isolated"], records)], "update_chi2")
    assert [r["role"] for r in rows] == ["generator", "aggregator"]
    assert rows[0]["ppl_peak_over_first"] == 1.5 and rows[0]["chi2_peak_over_first"] == 4.0
    assert rows[1]["ppl_peak_over_first"] is None
    assert tables.table2([CellRun.of(cells["base"], _vals({0: 0.1}))]) == []


# ---------------------------------------------------------------- Table 3


def test_table3_rows_from_saved_evaluations_and_missing_ones_say_so() -> None:
    t1 = [
        {"task": "a", "model": "m", "seed": 0, "workflow": "single", "policy": "sa_rl",
         "base": 0.2, "peak": 0.5},
        {"task": "a", "model": "m", "seed": 0, "workflow": "voting", "policy": "shared",
         "base": 0.3, "peak": 0.6},
        {"task": "a", "model": "m", "seed": 0, "workflow": "voting", "policy": "isolated",
         "base": 0.25, "peak": 0.6},
    ]  # fmt: skip
    voting, evalopt = ("a", "m", 0, "voting"), ("a", "m", 0, "eval_opt")
    results = {voting: {"val/accuracy": 0.55, "role": "generator", "sa_rl_final": 0.45, "checkpoint": "step_000003",
                        "val/problems": 40, "val/episode_errors": 0}}  # fmt: skip
    rows = tables.table3([voting, evalopt], results, t1)
    v, e = rows
    assert v["transfer"] == 0.55 and v["sa_rl_final"] == 0.45 and v["sa_rl_peak"] == 0.5
    assert v["workflow_base"] == 0.25  # the IP cell's step 0
    assert v["transfer_minus_base"] == pytest.approx(0.3)
    assert v["transfer_minus_sa_rl"] == pytest.approx(0.1)
    assert v["note"] is None and v["val_problems"] == 40 and v["role"] == "generator"
    assert e["transfer"] is None and "not evaluated" in e["note"]


# ---------------------------------------------------------------- Tables 4-6


def test_signature_tables_read_first_peak_and_final_checkpoints() -> None:
    cells = _cells(_raw(workflow=["voting", "eval_opt"]))
    sig = "val/sig/"
    voting = [
        {"step": 0, "val/accuracy": 0.2, "val/problems": 40, sig + "generator/len_mean": 5.0,
         sig + "aggregator/terse_rate": 0.9},
        {"step": 1, "train/reward_mean": 0.1},
        {"step": 2, "val/accuracy": 0.6, "val/problems": 40, sig + "generator/len_mean": 7.0,
         sig + "aggregator/terse_rate": 0.5, sig + "generator/jaccard3": 0.25},
        {"step": 4, "val/accuracy": 0.4, "val/problems": 40, sig + "generator/len_mean": 8.0},
    ]  # fmt: skip
    evalopt = [
        {"step": 0, "val/accuracy": 0.1, sig + "evaluator/iter1/python_code_fence": 0.0,
         sig + "evaluator/later/python_code_fence": 0.5, sig + "evaluator/boxed_correct_rate": 0.3},
    ]  # fmt: skip
    runs = [CellRun.of(cells["voting-shared"], voting),
            CellRun.of(cells["eval_opt-isolated"], evalopt)]  # fmt: skip
    t4, t5, t6 = tables.SIGNATURE_TABLES
    rows = tables.signature_rows(runs, t4)
    assert [(r["checkpoint"], r["step"]) for r in rows] == [("first", 0), ("peak", 2),
                                                            ("final", 4)]  # fmt: skip
    assert [r["generator_len_mean"] for r in rows] == [5.0, 7.0, 8.0]
    assert [r["aggregator_terse_rate"] for r in rows] == [0.9, 0.5, None]
    assert rows[1]["generator_jaccard3"] == 0.25 and rows[1]["val_problems"] == 40
    assert set(rows[0]) == set(tables.signature_columns(t4))
    five = tables.signature_rows(runs, t5)
    assert len(five) == 1 and five[0]["checkpoint"] == "first"
    assert five[0]["evaluator_iter1_python_code_fence"] == 0.0
    assert five[0]["evaluator_later_python_code_fence"] == 0.5
    assert five[0]["evaluator_boxed_correct_rate"] == 0.3
    assert five[0]["evaluator_unparseable_rate"] is None
    assert tables.signature_rows(runs, t6) == []


# ---------------------------------------------------------------- Fig. 5


def test_instability_statistics() -> None:
    cells = _cells()
    records = [
        _train(0, **{"role/generator/entropy": 2.0, "role/aggregator/entropy": 1.0,
                     "policy/shared/chi2_token": 0.1, "policy/shared/grad_norm": 0.5,
                     "role/generator/grad_norm": 9.0}),
        _train(1, **{"role/generator/entropy": 1.5, "role/aggregator/entropy": 0.2,
                     "policy/shared/chi2_token": 0.4, "policy/shared/grad_norm": 0.25}),
        _train(2, **{"role/generator/entropy": 1.8, "role/aggregator/entropy": 0.9}),
    ]  # fmt: skip
    st = tables.instability(CellRun.of(cells["voting-shared"], records))
    assert st["max_chi2"] == 0.4 and st["max_grad_norm"] == 0.5  # per adapter, not per role
    assert st["entropy_collapse"] == pytest.approx(0.8)  # the aggregator's 1.0 - 0.2
    run = CellRun.of(cells["voting-shared"], [_train(0, **{"policy/shared/grad_norm": 3.0})])
    assert tables.global_grad_norm(run) == [(0, 3.0)]
    assert tables.instability(run)["max_chi2"] is None


# ---------------------------------------------------------------- axes as mappings


def test_axis_values_may_be_mappings_of_spec_fields() -> None:
    raw = {
        "name": "paper",
        "base": {"train": {"steps": 3}},
        "axes": {
            "task": ["arithmetic",
                     {"name": "math", "data": {"train": "dapo_math", "train_path": "/d/m.parquet"},
                      "sampling": {"max_tokens": 512}}],
            "model": [{"name": "small", "model": {"path": "/models/s", "dtype": "bfloat16"},
                       "grpo": {"max_tokens_per_micro_batch": 4096}}, MODEL],
            "workflow": ["voting", {"name": "eo3", "workflow": "eval_opt",
                                    "caps": {"eval_opt_rounds_math": 2}}],
            "policy": ["shared", "isolated"],
        },
    }  # fmt: skip
    m = matrix.load_matrix(raw)
    by = {c.name: c for c in m.cells}
    c = by["math-small-s0-eo3-isolated"]
    assert (c.task, c.model, c.workflow, c.policy) == ("math", "small", "eo3", "isolated")
    s = c.spec
    assert s.data.train == s.data.val == "dapo_math" and s.data.train_path == "/d/m.parquet"
    assert s.sampling.max_tokens == 512 and s.caps.eval_opt_rounds_math == 2
    assert s.model.path == "/models/s" and s.model.dtype == "bfloat16"
    assert s.grpo.max_tokens_per_micro_batch == 4096 and s.workflow == "eval_opt"
    plain = by["arithmetic-m-s0-voting-shared"].spec
    assert plain.data.train == plain.data.val == "arithmetic" and plain.model.path == MODEL
    assert plain.sampling.max_tokens is None
    sa = by["math-small-s0-sa_rl"].spec  # the controls take the task's and the model's fields
    assert sa.workflow == "single" and sa.data.train_path == "/d/m.parquet"
    assert sa.grpo.max_tokens_per_micro_batch == 4096
    assert len(m.cells) == 2 * 2 * (2 + 2 * 2)
    # Table 3: one evaluation per (task, model, seed) and workflow with a generator role
    assert [t.name for t in m.transfers][:2] == ["arithmetic-small-s0-voting",
                                                 "arithmetic-small-s0-eo3"]  # fmt: skip
    assert len(m.transfers) == 2 * 2 * 2


@pytest.mark.parametrize(
    ("axes", "field"),
    [
        ({"model": [{"model": {"path": MODEL}}]}, r"axes\.model\[0\]\.name"),
        ({"task": ["arithmetic", {"name": "x", "data": {"train": "nope"}}]}, r"axes\.task\[1\]"),
        ({"model": [{"name": "m", "grpo": {"bogus": 1}}]}, r"axes.model\[0\]` \(m\).*grpo.bogus"),
        ({"seed": ["zero"]}, r"axes.seed\[0\]"),
        ({"task": [["arithmetic"]]}, r"axes.task\[0\]"),
        ({"task": ["arithmetic", {"name": "arithmetic"}]}, "two values named arithmetic"),
    ],
)
def test_bad_axis_values_name_the_field(axes: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError, match=field):
        matrix.load_matrix(_raw(**axes))


def test_no_transfer_without_sa_rl_or_a_generator_role() -> None:
    raw = {**_raw(), "controls": {"sa_rl": False}}
    assert matrix.load_matrix(raw).transfers == []
    assert len(matrix.load_matrix(_raw()).transfers) == 1


# ---------------------------------------------------------------- the report directory


def _write(root: Path, cell: matrix.Cell, rows: list[dict[str, Any]], run_id: str = "r") -> None:
    d = matrix.cell_dir(root, cell)
    d.mkdir(parents=True, exist_ok=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    matrix._mark(root, cell, "SUCCEEDED", run_id=run_id)


def _training(accs: dict[int, float], roles: list[str], adapters: list[str]) -> list[dict]:
    out = []
    for step in range(max(accs) + 1):
        r: dict[str, Any] = {"step": step, "alarms": [], "train/reward_mean": 0.1 * step,
                             "train/accuracy": 0.1 * step}  # fmt: skip
        for i, role in enumerate(roles):
            r |= {
                f"role/{role}/chi2_token": 0.01 * (step + 1 + i),
                f"role/{role}/training_ppl": 1.0 + 0.1 * step,
                f"role/{role}/update_chi2": 0.001 * (step + 1),
                f"role/{role}/grad_norm": 0.5 + 0.1 * i,
                f"role/{role}/entropy": 2.0 - 0.2 * step,
            }
        for a in adapters:
            r |= {
                f"policy/{a}/chi2_token": 0.02 * (step + 1),
                f"policy/{a}/grad_norm": 0.3,
                f"policy/{a}/training_ppl": 1.1,
            }
        if step in accs:
            r |= {
                "val/accuracy": accs[step],
                "val/problems": 10,
                "val/sig/generator/len_mean": 4.0 + step,
            }
        out.append(r)  # fmt: skip
    return out


def test_report_writes_every_table_figure_and_the_page(tmp_path: Path) -> None:
    raw = _raw(workflow=["voting", "orch_workers"])
    m = matrix.load_matrix(raw)
    matrix.prepare(tmp_path, m)
    for c in m.cells:
        if c.kind == "base":
            _write(tmp_path, c, [{"step": 0, "val/accuracy": 0.2, "alarms": []}])
            continue
        roles = list(tables.CellRun(c, []).routing)
        adapters = sorted(set(tables.CellRun(c, []).routing.values()))
        _write(tmp_path, c, _training({0: 0.2, 2: 0.5, 3: 0.3}, roles, adapters))
    t = m.transfers[0]
    path = matrix.transfer_path(tmp_path, t)
    path.parent.mkdir()
    path.write_text(json.dumps({"sa_rl_run_id": "r", "val/accuracy": 0.4, "sa_rl_final": 0.3,
                                "checkpoint": "step_000003", "val/problems": 10,
                                "val/episode_errors": 0}))  # fmt: skip
    paths = write_report(tmp_path)
    out = tmp_path / "report"
    names = [f"table{i}.{x}" for i in range(1, 7) for x in ("csv", "md")]
    names += [f"fig{i}.png" for i in range(2, 7)] + ["index.html", "table1_paper.csv"]
    for name in names:
        assert (out / name).is_file() and paths[name] == out / name, name
    for i in range(2, 7):
        assert (out / f"fig{i}.png").read_bytes()[:4] == b"\x89PNG"
    page = (out / "index.html").read_text()
    for name in names[:-2]:
        assert f"'{name}'" in page, name
    with (out / "table1.csv").open() as f:
        t1 = list(csv.DictReader(f))
    assert tuple(t1[0]) == tables.TABLE1 and len(t1) == len(m.cells)
    ip = next(r for r in t1 if r["policy"] == "isolated" and r["workflow"] == "voting")
    assert (ip["base"], ip["peak"], ip["peak_step"], ip["final"], ip["cliff"]) == (
        "0.2",
        "0.5",
        "2",
        "0.3",
        "1",
    )
    with (out / "table3.csv").open() as f:
        t3 = {r["workflow"]: r for r in csv.DictReader(f)}
    assert t3["voting"]["transfer"] == "0.4" and "not evaluated" in t3["orch_workers"]["note"]
    assert [t.name for t in m.transfers] == [
        "arithmetic-m-s0-voting",
        "arithmetic-m-s0-orch_workers",
    ]
    with (out / "table6.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 2 * 3  # 2 Orch-Workers cells x 3 checkpoints
    assert "| generator |" in (out / "table2.md").read_text()
    # a transfer made with an SA-RL run that is no longer there is not read
    sa = next(c for c in m.cells if c.kind == "sa_rl")
    matrix._mark(tmp_path, sa, "SUCCEEDED", run_id="another")
    write_report(tmp_path, tmp_path / "again", "update_chi2")
    with (tmp_path / "again" / "table3.csv").open() as f:
        assert all(r["transfer"] == "" for r in csv.DictReader(f))
    status = matrix.status_lines(tmp_path, m)
    assert any(line.startswith("table3/") and "pending" in line for line in status)


def test_report_of_an_empty_matrix_directory_still_writes_every_file(tmp_path: Path) -> None:
    matrix.prepare(tmp_path, matrix.load_matrix(_raw()))
    paths = write_report(tmp_path)
    assert "No Table 3 evaluation found" in paths["table3.md"].read_text()
    assert all(paths[f"fig{i}.png"].is_file() for i in range(2, 7))
    with pytest.raises(SpecError, match="--chi2"):
        write_report(tmp_path, chi2="chi2")
