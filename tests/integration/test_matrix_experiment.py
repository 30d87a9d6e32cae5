"""`marl matrix`, `marl matrix report`, `marl eval` and `marl attribute` end to end on the
demo model and task.

Every workflow (single, voting, eval_opt, orch_workers) x 2 policies with the base-model and
SA-RL controls runs embedded, is SIGKILLed after a few cells and started again: only the
missing cells run, then Table 3's SA-RL transfer evaluations. The report's every table and
figure exists, and Tables 1 and 2 agree with numbers recomputed here from the runs' own
metrics.jsonl. Then mixed-deployment evaluation and role attribution on those runs reproduce
the accuracies the runs logged.
"""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from marl.experiments.evaluate import EvalCluster, format_attribution, run_spec

MATRIX = {
    "name": "demo-matrix",
    "base": {
        "engine": "transformers",
        "lora": {"rank": 16, "alpha": 32},
        "optim": {"lr": 1e-3, "warmup_steps": 0, "schedule": "constant"},
        "grpo": {"group_size": 8, "mini_batch_size": 16, "micro_batch_sequences": 128},
        "train": {
            "steps": 3,
            "problems_per_step": 8,
            "val_interval": 1,
            "val_problems": 40,
            "checkpoint_interval": 1,
            "step_timeout_s": 300,
        },
        "sampling": {"temperature": 1.0, "max_tokens": 8},
    },
    "axes": {
        "workflow": ["single", "voting", "eval_opt", "orch_workers"],
        "policy": ["shared", "isolated"],
        "task": ["arithmetic"],
        "model": ["demo"],
    },
}
PREFIX = "arithmetic-demo-s0"
ROLES = {
    "single": ["generator"],
    "voting": ["generator", "aggregator"],
    "eval_opt": ["generator", "evaluator"],
    "orch_workers": ["orchestrator", "worker", "synthesizer"],
}
WORKFLOWS = list(ROLES)
CELLS = [f"{PREFIX}-{c}" for c in ("base", "sa_rl")] + [
    f"{PREFIX}-{w}-{p}" for w in WORKFLOWS for p in ("shared", "isolated")
]
KILL_AFTER = 3
TOL = 1e-9


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "marl.cli", *args], capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _state(root: Path, cell: str) -> dict[str, Any] | None:
    path = root / "cells" / cell / "cell.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _rows(root: Path, cell: str) -> list[dict[str, Any]]:
    text = (root / "cells" / cell / "metrics.jsonl").read_text()
    return [json.loads(x) for x in text.splitlines() if x.strip()]


def _vals(root: Path, cell: str) -> dict[int, float]:
    return {r["step"]: r["val/accuracy"] for r in _rows(root, cell) if "val/accuracy" in r}


def _csv(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def _num(text: str) -> float | None:
    return None if text == "" else float(text)


def _close(got: str, want: float | None) -> bool:
    value = _num(got)
    if value is None or want is None:
        return value is None and want is None
    return abs(value - want) <= TOL


def _peak_over_first(
    rows: list[dict[str, Any]], prefix: str, metric: str
) -> tuple[float | None, int | None]:
    """Table 2's ratio and peak step, recomputed: the metric under its name, or under the
    name the learner logged it by before the rename, whichever the run has."""
    for name in (metric, {"training_ppl": "perplexity", "update_chi2": "chi2"}.get(metric)):
        pts = [
            (r["step"], float(r[prefix + name]))
            for r in rows
            if name is not None and r.get(prefix + name) is not None
        ]
        if pts:
            first, top = pts[0][1], max(v for _, v in pts)
            return (top / first if first > 0 else None), min(s for s, v in pts if v == top)
    return None, None


@pytest.fixture(scope="module")
def matrix_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("matrix")
    spec = tmp / "matrix.yaml"
    spec.write_text(yaml.safe_dump(MATRIX))
    root = tmp / "out"
    started = time.monotonic()
    with (tmp / "first.log").open("w") as log:
        first = subprocess.Popen(
            [sys.executable, "-m", "marl.cli", "matrix", str(spec), "--out", str(root)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        while first.poll() is None:
            if sum((_state(root, c) or {}).get("state") == "SUCCEEDED" for c in CELLS) >= (
                KILL_AFTER
            ):
                break
            assert time.monotonic() - started < 600, (tmp / "first.log").read_text()
            time.sleep(0.2)
        first.send_signal(signal.SIGKILL)
        first.wait()
    killed_at = time.monotonic() - started
    before = {c: _state(root, c) for c in CELLS}
    second = _cli("matrix", str(spec), "--out", str(root), timeout=900)
    return {
        "root": root,
        "before": before,
        "out": second.stdout,
        "killed_at": killed_at,
        "seconds": time.monotonic() - started,
    }


@pytest.mark.slow
@pytest.mark.matrix
@pytest.mark.timeout(1200)
def test_a_killed_matrix_finishes_only_the_missing_cells(matrix_run: dict[str, Any]) -> None:
    root, before = matrix_run["root"], matrix_run["before"]
    print(f"killed after {matrix_run['killed_at']:.0f}s; both runs {matrix_run['seconds']:.0f}s")
    print(matrix_run["out"])
    done = [c for c, s in before.items() if s and s["state"] == "SUCCEEDED"]
    assert KILL_AFTER <= len(done) < len(CELLS), before
    assert f"{len(done)} done, {len(CELLS) - len(done)} to run" in matrix_run["out"]
    for cell in CELLS:
        after = _state(root, cell)
        assert after is not None and after["state"] == "SUCCEEDED", (cell, after)
        if cell in done:
            assert after == before[cell]  # not run again: same run id, same record
        else:
            assert f"{cell}: " in matrix_run["out"]
    for cell in done:
        assert f"{cell}: " not in matrix_run["out"]


@pytest.mark.slow
@pytest.mark.matrix
@pytest.mark.timeout(1200)
def test_table_agrees_with_the_runs_metrics(matrix_run: dict[str, Any]) -> None:
    root = matrix_run["root"]
    report = _cli("matrix", "report", str(root))
    assert "| arithmetic | demo | 0 | voting |" in report.stdout
    rows = {r["workflow"]: r for r in _csv(root / "report" / "table1_paper.csv")}
    assert set(rows) == set(WORKFLOWS)
    base = _vals(root, f"{PREFIX}-base")
    sa = _vals(root, f"{PREFIX}-sa_rl")
    assert list(base) == [0] and base[0] == sa[0]  # version 0 is the base model
    assert sorted(sa) == [0, 1, 2, 3]
    sa_peak = max(v for s, v in sa.items() if s >= 1)
    for workflow, row in rows.items():
        assert float(row["sa_rl"]) == sa_peak
        ip0 = _vals(root, f"{PREFIX}-{workflow}-isolated")[0]
        assert ip0 == _vals(root, f"{PREFIX}-{workflow}-shared")[0]  # both the base model
        assert float(row["base"]) == ip0  # the workflow's own, untrained
        for policy, p in (("isolated", "ip"), ("shared", "sp")):
            vals = _vals(root, f"{PREFIX}-{workflow}-{policy}")
            peak = max(v for s, v in vals.items() if s >= 1)
            assert float(row[f"{p}_peak"]) == peak
            assert int(row[f"{p}_peak_step"]) == min(
                s for s, v in vals.items() if v == peak and s >= 1
            )
            assert float(row[f"{p}_final"]) == vals[3]
            assert float(row[f"{p}_cliff"]) == vals[3] - peak
            assert float(row[f"{p}_residual"]) == peak - sa_peak
    assert (root / "report" / "fig3.png").read_bytes()[:4] == b"\x89PNG"
    status = _cli("matrix", "status", str(root)).stdout
    assert all(f"{c} " in status for c in CELLS)
    assert status.count(" done ") == len(CELLS) + len(WORKFLOWS)  # and Table 3's evaluations


@pytest.mark.slow
@pytest.mark.matrix
@pytest.mark.timeout(1200)
def test_report_has_every_table_and_figure_and_agrees_with_the_runs(
    matrix_run: dict[str, Any],
) -> None:
    root = matrix_run["root"]
    _cli("matrix", "report", str(root))
    _cli("matrix", "report", str(root), "--chi2", "update_chi2", "--out", str(root / "upd"))
    _cli("matrix", "report", str(root), "--chi2", "chi2_token", "--out", str(root / "tok"))
    out = root / "report"
    names = [f"table{i}.{x}" for i in range(1, 7) for x in ("csv", "md")]
    names += [f"fig{i}.png" for i in range(2, 7)]
    page = (out / "index.html").read_text()
    for name in names:
        assert (out / name).is_file() and (root / "upd" / name).is_file(), name
        assert f"'{name}'" in page, name
        if name.endswith(".png"):
            assert (out / name).read_bytes()[:4] == b"\x89PNG"

    # Table 1, recomputed per cell: Base is the cell's own step 0, peak over steps >= 1
    t1 = {r["cell"]: r for r in _csv(out / "table1.csv")}
    assert set(t1) == set(CELLS)
    sa = _vals(root, f"{PREFIX}-sa_rl")
    sa_peak = max(v for s, v in sa.items() if s >= 1)
    for cell in CELLS:
        vals, row = _vals(root, cell), t1[cell]
        assert _close(row["base"], vals[0]), (cell, row)
        if cell.endswith("-base"):
            assert row["peak"] == "" and row["policy"] == "base_model"
            continue
        later = {s: v for s, v in vals.items() if s >= 1}
        peak = max(later.values())
        final = later[max(later)]
        assert _close(row["peak"], peak) and _close(row["final"], final), (cell, row)
        assert int(row["peak_step"]) == min(s for s, v in later.items() if v == peak)
        assert _close(row["delta_peak"], peak - vals[0])
        assert _close(row["delta_final"], final - vals[0])
        assert row["cliff"] == str(int(peak - final >= 0.1 - 1e-12))
        if not cell.endswith("-sa_rl"):
            assert _close(row["vs_sa_rl"], peak - sa_peak)

    # Table 2, recomputed from the runs' per-role (and under SP, per-adapter) series. On
    # this float32 CPU matrix learner and sampler agree, chi2_token is rounding noise, and
    # the default (`auto`) reads update_chi2 and says so; chi2_token asked for by name
    # prints no ratio of noise
    tok = _csv(root / "tok" / "table2.csv")
    assert tok and {(r["chi2_metric"], r["chi2_peak_over_first"]) for r in tok} == {
        ("chi2_token: noise floor", "")}
    for folder, chi2 in ((out, "update_chi2"), (root / "upd", "update_chi2")):
        t2 = {(r["workflow"], r["policy"], r["role"]): r for r in _csv(folder / "table2.csv")}
        assert {r["chi2_metric"] for r in t2.values()} == {"update_chi2"}
        want: set[tuple[str, str, str]] = set()
        for cell in CELLS[1:]:
            workflow, policy = (
                ("single", "sa_rl")
                if cell.endswith("sa_rl")
                else (cell.removeprefix(f"{PREFIX}-").split("-"))
            )
            rows = _rows(root, cell)
            series = [(role, f"role/{role}/") for role in ROLES[workflow]]
            if policy == "shared" and len(ROLES[workflow]) > 1:
                series.append(("shared", "policy/shared/"))
            for role, prefix in series:
                want.add((workflow, policy, role))
                row = t2[(workflow, policy, role)]
                ratio, step = _peak_over_first(rows, prefix, chi2)
                assert _close(row["chi2_peak_over_first"], ratio), (cell, role, row)
                assert row["chi2_peak_step"] == ("" if step is None else str(step))
                for col, metric in (
                    ("ppl_peak_over_first", "training_ppl"),
                    ("grad_norm_peak_over_first", "grad_norm"),
                ):
                    assert _close(row[col], _peak_over_first(rows, prefix, metric)[0]), (
                        cell,
                        role,
                        col,
                        row,
                    )
        assert set(t2) == want
        # the series move on a CPU run, so the recompute is not of blanks alone
        assert any(r["ppl_peak_over_first"] for r in t2.values())
        assert any(r["chi2_peak_over_first"] for r in t2.values())

    # Table 3: the SA-RL adapter on each workflow's generator (Orch-Workers' workers)
    t3 = {r["workflow"]: r for r in _csv(out / "table3.csv")}
    assert set(t3) == set(WORKFLOWS)
    for workflow, row in t3.items():
        assert row["note"] == "" and row["episode_errors"] == "0" and row["val_problems"] == "40"
        assert row["role"] == ("worker" if workflow == "orch_workers" else "generator")
        assert row["sa_rl_checkpoint"] == "step_000003" and float(row["sa_rl_final"]) == sa[3]
        assert 0.0 <= float(row["transfer"]) <= 1.0
    # on Single the transfer is the SA-RL run itself at its last step
    assert float(t3["single"]["transfer"]) == sa[3]

    # Tables 4-6: each cell of the workflow at its first, peak and final validation
    for number, workflow, col, key in (
        (4, "voting", "generator_len_mean", "val/sig/generator/len_mean"),
        (5, "eval_opt", "evaluator_iter1_bare_stamp", "val/sig/evaluator/iter1/bare_stamp"),
        (6, "orch_workers", "worker_len_mean", "val/sig/worker/len_mean"),
    ):
        rows = _csv(out / f"table{number}.csv")
        assert {r["workflow"] for r in rows} == {workflow} and len(rows) == 2 * 3
        for r in rows:
            record = next(
                x
                for x in _rows(root, f"{PREFIX}-{workflow}-{r['policy']}")
                if x["step"] == int(r["step"])
            )
            assert _close(r[col], record.get(key)), (number, r)
            assert r["val_problems"] == "40"


@pytest.fixture(scope="module")
def redis_url(matrix_run: dict[str, Any]) -> Iterator[str]:
    spec = run_spec(matrix_run["root"] / "cells" / f"{PREFIX}-sa_rl")
    with (
        tempfile.TemporaryDirectory(prefix="marl-eval-") as tmp,
        EvalCluster(Path(tmp), spec) as url,
    ):
        yield url


@pytest.mark.slow
@pytest.mark.matrix
@pytest.mark.timeout(1200)
def test_eval_reproduces_each_runs_own_accuracy(matrix_run: dict[str, Any], redis_url: str) -> None:
    root = matrix_run["root"]
    sa_dir = root / "cells" / f"{PREFIX}-sa_rl"
    sa = _vals(root, f"{PREFIX}-sa_rl")

    def evaluate(run: Path, adapters: str) -> dict[str, Any]:
        out = _cli("eval", str(run), "--adapters", adapters, "--redis", redis_url, "--json")
        result: dict[str, Any] = json.loads(out.stdout)
        assert result["val/problems"] == 40 and result["val/episode_errors"] == 0
        return result

    # the SA-RL adapter on the generator, the workflow's only role: its own run's accuracy
    assert evaluate(sa_dir, f"generator={sa_dir}@3")["val/accuracy"] == sa[3]
    assert evaluate(sa_dir, f"generator={sa_dir}@step_1")["val/accuracy"] == sa[1]
    # no role mapped: the base model, i.e. the run's step 0 and the base control
    assert evaluate(sa_dir, "")["val/accuracy"] == sa[0]
    # a multi-role workflow with every role mapped to the adapter it trained
    shared_dir = root / "cells" / f"{PREFIX}-voting-shared"
    shared = _vals(root, f"{PREFIX}-voting-shared")
    assert evaluate(shared_dir, f"*={shared_dir}@3")["val/accuracy"] == shared[3]
    # Table 3: the SA-RL adapter deployed on Voting's generators only
    mixed = evaluate(shared_dir, f"generator={sa_dir}@best,aggregator=base")
    assert mixed["routing"]["aggregator"] == "base"
    assert mixed["routing"]["generator"].endswith(":shared")
    assert 0.0 <= mixed["val/accuracy"] <= 1.0


@pytest.mark.slow
@pytest.mark.matrix
@pytest.mark.timeout(1200)
def test_attribute_rows_per_role_and_base_reproduces_step_0(
    matrix_run: dict[str, Any], redis_url: str
) -> None:
    root = matrix_run["root"]
    for cell, roles in (("sa_rl", ["generator"]), ("voting-isolated", ["generator", "aggregator"])):
        run = root / "cells" / f"{PREFIX}-{cell}"
        vals = _vals(root, f"{PREFIX}-{cell}")
        out = _cli("attribute", str(run), "--checkpoint", "3", "--redis", redis_url, "--json")
        result = json.loads(out.stdout)
        print(format_attribution(result))
        assert [r["role"] for r in result["roles"]] == roles and result["episode_errors"] == 0
        assert result["accuracy"] == vals[3]
        assert result["accuracy_baseline"] == vals[0]  # every role on the base model: step 0
        for r in result["roles"]:
            assert r["contribution"] == result["accuracy"] - r["accuracy_without"]
        if cell == "sa_rl":  # one role: replacing it is replacing everything
            assert result["roles"][0]["accuracy_without"] == vals[0]
        text = format_attribution(result)
        assert all(f"\n{role} " in text for role in roles)


@pytest.mark.slow
@pytest.mark.matrix
@pytest.mark.timeout(900)
def test_on_a_cluster_a_killed_matrix_follows_its_run_instead_of_restarting(
    tmp_path: Path,
) -> None:
    from marl.clients.runs import RunsClient
    from marl.local.launcher import Cluster
    from marl.models.demo import demo_model_dir

    raw = {
        **MATRIX,
        "axes": {**MATRIX["axes"], "workflow": ["voting"], "policy": ["shared"]},
        "controls": {"sa_rl": False},
    }
    spec = tmp_path / "matrix.yaml"
    spec.write_text(yaml.safe_dump(raw))
    root = tmp_path / "out"
    cell = f"{PREFIX}-voting-shared"
    with Cluster(tmp_path / "cluster", str(demo_model_dir()), max_lora_rank=16) as cluster:
        endpoints = cluster.endpoints()
        args = [
            "matrix",
            str(spec),
            "--out",
            str(root),
            "--learner",
            endpoints["learner"],
            "--redis",
            endpoints["redis"],
        ]
        with (tmp_path / "first.log").open("w") as log:
            first = subprocess.Popen(
                [sys.executable, "-m", "marl.cli", *args], stdout=log, stderr=subprocess.STDOUT
            )
            deadline = time.monotonic() + 300
            metrics = root / "cells" / cell / "metrics.jsonl"
            while not (metrics.is_file() and metrics.read_text().count("\n") >= 1):
                assert first.poll() is None, (tmp_path / "first.log").read_text()
                assert time.monotonic() < deadline, (tmp_path / "first.log").read_text()
                time.sleep(0.1)
            first.send_signal(signal.SIGKILL)
            first.wait()
        record = _state(root, cell)
        assert record is not None and record["state"] == "RUNNING", record
        with RunsClient(endpoints["learner"]) as runs:
            assert runs.get(record["run_id"]).state in ("QUEUED", "RUNNING")
        assert "(run " in _cli("matrix", "status", str(root)).stdout
        second = _cli(*args)
        assert f"run {record['run_id']} (resumed following it)" in second.stdout, second.stdout
        assert "1 done, 1 to run" in second.stdout  # the base control was done before
        final = _state(root, cell)
        assert final is not None and final["state"] == "SUCCEEDED"
        assert final["run_id"] == record["run_id"]
        assert list(_vals(root, cell)) == [0, 1, 2, 3]
        with RunsClient(endpoints["learner"]) as runs:
            assert len(runs.list()) == 1  # no second run was submitted
