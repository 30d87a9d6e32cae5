"""marl.monitor.trace_summary: a step's wait split into generation, reward and queueing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from marl.cli import main as cli
from marl.monitor import trace_summary
from marl.monitor.trace_summary import intersect, length, minus, step_times, union


def span(name: str, start: float, end: float, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "name": name, "pid": 1, "tid": 1, "ts": round(start * 1e6),
            "dur": round((end - start) * 1e6), "args": args}


def test_interval_arithmetic() -> None:
    assert union([(3, 4), (0, 1), (0.5, 2), (2, 2.5)]) == [(0, 2.5), (3, 4)]
    assert intersect([(0, 2.5), (3, 4)], [(1, 3.5)]) == [(1, 2.5), (3, 3.5)]
    assert minus([(0, 10)], [(1, 2), (5, 6), (9, 12)]) == [(0, 1), (2, 5), (6, 9)]
    assert minus([(0, 1), (3, 4)], [(-1, 0.5), (0.8, 3.2)]) == [(0.5, 0.8), (3.2, 4)]
    assert length([(0, 1), (2, 2.5)]) == 1.5


STEP = [
    span("step", 10.0, 11.0, run="r", step=1),
    span("rollout wait", 10.0, 10.4, run="r", step=1),
    span("update", 10.4, 10.9, run="r", step=1),
    span("push", 10.9, 10.95, run="r", step=1),
    span("prefill", 10.1, 10.2, rows=16),
    span("decode", 10.2, 10.3, rows=16),
    span("decode", 10.35, 10.45, rows=2),  # ends inside the update: counted up to 10.4
    span("score", 10.25, 10.38, task="t"),  # scored alone only in 10.30-10.35
    span("decode", 9.0, 9.5, rows=1),  # another run's: outside the window
    span("episode", 10.05, 10.38, task="t"),
]


def test_the_wait_splits_into_generation_reward_and_queueing() -> None:
    (s,) = step_times(STEP)
    assert (s.run, s.step) == ("r", 1)
    assert s.start == pytest.approx(10.0)
    assert s.step_s == pytest.approx(1.0)
    assert s.wait == pytest.approx(0.4)
    assert s.generation == pytest.approx(0.25)
    assert s.reward == pytest.approx(0.05)
    assert s.queueing == pytest.approx(0.10)
    assert (s.update, s.push, s.other) == pytest.approx((0.5, 0.05, 0.05))
    assert (s.flight, s.flight_generation) == (s.wait, s.generation)  # no flight span
    shares = trace_summary.shares([s])
    assert shares["generation"] == pytest.approx(0.25)
    assert shares["queueing"] == pytest.approx(0.10)


def test_a_flight_that_began_before_the_step_counts_its_generation() -> None:
    """A synchronous step whose tasks left while the step before was logged: the replica's
    prefill at 9.95-10.0 is of its flight, not of its wait."""
    early = [*STEP, span("rollout flight", 9.9, 10.4, run="r", step=1),
             span("prefill", 9.95, 10.0, rows=16)]
    (s,) = step_times(early)
    assert s.flight == pytest.approx(0.5)
    assert s.flight_generation == pytest.approx(0.30)
    assert s.generation == pytest.approx(0.25)


def test_steps_per_s_counts_the_time_between_steps() -> None:
    def steps(run: str, starts: list[float]) -> list[dict[str, Any]]:
        return [e for n, t in enumerate(starts, 1) for e in (
            span("step", t, t + 0.5, run=run, step=n),
            span("rollout wait", t, t + 0.2, run=run, step=n),
        )]

    # run a: 2 steps in 1.5 s (0.5 s spans, 0.25 s between); run b: 1 step in 1 s
    times = step_times(steps("a", [0.0, 0.75, 1.5]) + steps("b", [5.0, 6.0]))
    assert trace_summary.steps_per_s(times) == pytest.approx(3 / 2.5)
    assert trace_summary.steps_per_s(times[:1]) == 0.0


def test_a_step_cut_short_is_left_out() -> None:
    cut = [e for e in STEP if e["name"] != "step"]
    assert step_times(cut) == []


def test_marl_trace_prints_the_steps_and_merges_the_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [json.dumps(e) for e in STEP]
    (tmp_path / "learner-1.jsonl").write_text("\n".join(lines[:4]) + "\n")
    (tmp_path / "inference-2.jsonl").write_text("\n".join(lines[4:]) + '\n{"ph": "X", "na')
    assert cli.main(["trace", str(tmp_path), "--skip", "0"]) == 0
    out = capsys.readouterr().out
    assert "run r: 1 steps after the first 0" in out
    assert "median ms       1000.0      400.0      250.0       50.0      100.0      500.0" in out
    assert out.splitlines()[1].split()[-1] == "flight"  # the wait's, with no flight span
    assert out.splitlines()[2].split()[-1] == "400.0"
    assert out.splitlines()[4] == "full garbage collections: none"
    merged = json.loads((tmp_path / "trace.json").read_text())
    assert len(merged["traceEvents"]) == len(STEP)  # the line cut short is skipped


def test_full_collections_during_the_steps_are_counted_by_service() -> None:
    named = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "learner"}},
             {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "workflow"}}]
    collections = [
        span("gc", 10.1, 10.3, generation=2, collected=0),
        span("gc", 10.5, 10.6, generation=2, collected=5),
        span("gc", 10.2, 10.201, generation=0, collected=9),  # a young one: not counted
        span("gc", 12.0, 12.2, generation=2, collected=0),  # after the steps
        {**span("gc", 10.4, 10.45, generation=2, collected=0), "pid": 2},
        {**span("gc", 10.7, 10.8, generation=2, collected=0), "pid": 3},  # no name
    ]
    assert trace_summary.collections_between(
        trace_summary.full_collections(named + collections), 10.0, 11.0) == (
        "learner: 2 (300 ms, longest 200); pid 3: 1 (100 ms, longest 100); "
        "workflow: 1 (50 ms, longest 50)")
    assert trace_summary.collections_between(
        trace_summary.full_collections(named), 10.0, 11.0) == "none"
    report = trace_summary.report(step_times(STEP + collections[:2]), events=STEP + collections)
    assert report.splitlines()[-1] == (
        "full garbage collections: pid 1: 2 (300 ms, longest 200); pid 2: 1 (50 ms, "
        "longest 50); pid 3: 1 (100 ms, longest 100)")
    assert "garbage" not in trace_summary.report(step_times(STEP))


def test_marl_trace_of_a_directory_without_traces_says_how_to_make_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["trace", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no trace files" in err and "--trace" in err
