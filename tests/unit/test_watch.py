"""`marl watch` on a run directory: the per-role table, normalised signals, alarms as they fire."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from rich.console import Console

from marl.cli.main import main
from marl.monitor.watch import WatchState, tail_records, watch_dir


def _write_run(path: Path, records: list[dict[str, object]], partial: str = "") -> None:
    path.mkdir()
    spec = {"name": "w", "workflow": "voting", "policy": "isolated", "train": {"steps": 6}}
    (path / "run.yaml").write_text(yaml.safe_dump(spec))
    text = "".join(json.dumps(r) + "\n" for r in records) + partial
    (path / "metrics.jsonl").write_text(text)


RECORDS: list[dict[str, object]] = [
    {"step": 0, "val/accuracy": 0.5, "alarms": []},
    *(
        {
            "step": s,
            "train/reward_mean": 0.1 * s,
            "role/generator/chi2_token": [0.05, 0.05, 0.05, 0.2, 0.3, 0.3][s - 1],
            "role/aggregator/chi2_token": 0.05,
            "role/generator/entropy": 0.8,
            "alarms": ["from the learner"] if s == 2 else [],
        }
        for s in range(1, 7)
    ),
]


def test_tail_records_waits_for_a_whole_line(tmp_path: Path) -> None:
    f = tmp_path / "m.jsonl"
    f.write_text('{"step": 0}\n{"step": 1')
    assert list(tail_records(f, follow=False)) == [{"step": 0}]


def test_watch_state_shows_normalised_chi2_and_every_alarm_once(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _write_run(run, RECORDS)
    console = Console(record=True, width=160, force_terminal=False)
    assert watch_dir(run, follow=False, console=console) == 0
    screen = console.export_text()
    last = screen[screen.rindex("step 6/6") :]
    assert "DONE" in last
    assert "6.00x" in last  # generator chi2 0.3 over its first 0.05
    assert "1.00x" in last  # aggregator flat
    assert last.count("step 2: from the learner") == 1
    # recomputed under the run's thresholds (generator is Voting's parallel role): the mean
    # of the last 3 values over that of the first 3, 0.8 / 3 / 0.05
    assert "gradient_amplification[generator]@6: chi2_token 5.33x" in last
    assert "no alarms" not in last


def test_watch_state_without_a_spec_shows_only_logged_alarms() -> None:
    state = WatchState(None, 0)
    for r in RECORDS:
        state.add(r)  # type: ignore[arg-type]
    assert state.alarms == ["step 2: from the learner"]
    assert state.roles() == ["aggregator", "generator"]


def test_cli_watch_once_and_user_error(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    run = tmp_path / "run"
    _write_run(run, RECORDS[:2])
    assert main(["watch", str(run), "--once"]) == 0
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["watch", str(empty), "--once"]) == 2
    assert "not a run directory" in capsys.readouterr().err


class _Event:
    def __init__(self, state: str, out_dir: str, metrics: dict[str, object] | None):
        self.run = type("Run", (), {"state": state, "total_steps": 6, "out_dir": out_dir})()
        self.metrics_json = json.dumps(metrics) if metrics is not None else ""


class _Learner:
    """The learner's WatchRun stream, replayed (the stub stands in for the gRPC channel)."""

    def __init__(self, events: list[_Event]):
        self.events = events
        self.asked: list[str] = []

    def WatchRun(self, request):  # type: ignore[no-untyped-def]  # noqa: N802
        self.asked.append(request.run_id)
        return iter(self.events)


def test_watch_run_follows_the_learner_stream_with_the_runs_thresholds(tmp_path: Path) -> None:
    from marl.monitor.watch import watch_run

    run = tmp_path / "run"
    _write_run(run, [])
    events = [_Event("RUNNING", str(run), r) for r in RECORDS]
    events.append(_Event("SUCCEEDED", str(run), None))
    learner = _Learner(events)
    console = Console(record=True, width=160, force_terminal=False)
    assert watch_run(learner, "w-1", console) == "SUCCEEDED"
    assert learner.asked == ["w-1"]
    screen = console.export_text()
    last = screen[screen.rindex("step 6/6") :]
    assert "SUCCEEDED" in last
    assert "gradient_amplification[generator]@6" in last  # out_dir's run.yaml thresholds
