"""`marl matrix --parallel N` (issue 70): up to N cells train at once, each cell's progress
on whole lines of its own; the embedded cluster's learner trains N runs at once and its
replicas hold the adapters of the N runs with the most in flight. The Runs API and the
cluster are stand-ins here (tests/integration/test_matrix_experiment.py runs the real
matrix)."""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import marl.clients.runs
import marl.local.launcher
from marl.experiments import matrix
from marl.spec.run import SpecError


def _matrix() -> matrix.Matrix:
    return matrix.load_matrix({
        "name": "t",
        "base": {"model": {"path": "/models/m"}, "train": {"steps": 2},
                 "data": {"train": "arithmetic", "val": "arithmetic"}},
        "axes": {"workflow": ["single", "voting", "orch_workers"],
                 "policy": ["shared", "isolated"]},
        "controls": {"base": False, "sa_rl": False},
    })  # fmt: skip


class Runs:
    """The Runs API: a run trains for a moment after it is watched; records how many
    trained at once."""

    at_once = 0
    most_at_once = 0
    submitted: list[str] = []
    lock = threading.Lock()

    def __init__(self, address: str):
        pass

    def __enter__(self) -> Runs:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def submit(self, spec: Any) -> str:
        with Runs.lock:
            Runs.submitted.append(spec.name)
        return f"{spec.name}-0"

    def watch(self, run_id: str) -> Any:
        with Runs.lock:
            Runs.at_once += 1
            Runs.most_at_once = max(Runs.most_at_once, Runs.at_once)
        time.sleep(0.3)
        with Runs.lock:
            Runs.at_once -= 1
        return iter(())

    def get(self, run_id: str) -> Any:
        return marl.clients.runs.RunInfo(run_id, "SUCCEEDED", 2, 2, "", "", None, 0.0, "")


@pytest.fixture()
def runs(monkeypatch: pytest.MonkeyPatch) -> type[Runs]:
    Runs.at_once = Runs.most_at_once = 0
    Runs.submitted = []
    monkeypatch.setattr(marl.clients.runs, "RunsClient", Runs)
    return Runs


def test_parallel_cells_train_at_once_each_on_whole_lines(
    runs: type[Runs], tmp_path: Path
) -> None:
    m = _matrix()
    out = io.StringIO()
    assert matrix.run_matrix(m, tmp_path, learner="l:1", out=out, parallel=2) == 0
    assert runs.most_at_once == 2
    assert sorted(runs.submitted) == sorted(c.name for c in m.cells)
    lines = out.getvalue().splitlines()
    assert "6 to run, 2 at a time" in lines[0]
    for cell in m.cells:
        mine = [line for line in lines if f"] {cell.name}: " in line]
        assert len(mine) == 2, lines
        assert mine[0].endswith(f"run {cell.name}-0")
        assert "SUCCEEDED in" in mine[1]


def test_one_cell_at_a_time_keeps_its_line(runs: type[Runs], tmp_path: Path) -> None:
    out = io.StringIO()
    assert matrix.run_matrix(_matrix(), tmp_path, learner="l:1", out=out) == 0
    assert runs.most_at_once == 1
    lines = out.getvalue().splitlines()
    assert len(lines) == 7
    assert all("SUCCEEDED in" in line and ": run " in line for line in lines[1:]), lines


def test_the_embedded_cluster_trains_n_runs_at_once(
    runs: type[Runs], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[dict[str, Any]] = []

    class Cluster:
        def __init__(self, *args: Any, **kwargs: Any):
            started.append(kwargs)

        def start(self) -> dict[str, Any]:
            return {"learner": "l:1", "redis": "redis://x"}

        def stop(self) -> None:
            pass

    monkeypatch.setattr(marl.local.launcher, "Cluster", Cluster)
    monkeypatch.setattr(matrix, "resolve_engine", lambda name: "vllm")
    m = _matrix()
    assert matrix.run_matrix(m, tmp_path, out=io.StringIO(), parallel=3) == 0
    (kwargs,) = started
    assert kwargs["max_concurrent_runs"] == 3
    assert kwargs["threads"] == marl.local.launcher.service_threads(2, overlapped=True)
    in_flight = sorted(
        (matrix.adapter_versions_in_flight(c.spec) for c in m.cells), reverse=True
    )
    assert kwargs["max_loras"] == sum(in_flight[:3]) > max(in_flight)
    assert runs.most_at_once == 3


def test_parallel_below_one_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="--parallel"):
        matrix.run_matrix(_matrix(), tmp_path, learner="l:1", out=io.StringIO(), parallel=0)
