"""The learner's record path: alarms land in metrics.jsonl at their onset, and the guard stops.

A real RunExecutor on a private Redis logs hand-made step records through all its sinks
(metrics.jsonl, the run record, the metrics stream, TensorBoard); no training happens.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

import marl
from marl.runtime import streams
from marl.spec.run import parse_spec
from marl.spec.services import LearnerConfig
from services.learner.guard import GuardStopped
from services.learner.runs import RunStore
from services.learner.trainer import RunExecutor

VAL = [0.2, 0.6, 0.55, 0.45, 0.4]
"""Validation accuracy at steps 0..4: the cliff (0.1 below the best 0.6) opens at step 3."""


async def log_steps(redis_url: str, out: Path, spec_data: dict[str, Any]) -> GuardStopped | None:
    from marl.runtime.metric_sinks import extra_sinks

    r = streams.connect(redis_url)
    model = Path(marl.__file__).parent / "assets" / "demo-model"
    spec = parse_spec({"workflow": "voting", "model": {"path": str(model)}, **spec_data})
    executor = RunExecutor(
        "run-1", spec, out, r, RunStore(r), "learner-t", extra_sinks=extra_sinks(spec, out, "run-1"),
        learner=LearnerConfig(),
    )
    stopped = None
    try:
        for step, acc in enumerate(VAL):
            await executor.record_step(step, {"val/accuracy": acc})
    except GuardStopped as err:
        stopped = err
    finally:
        await executor.records.close()
        await r.aclose()
    return stopped


def test_alarm_logged_at_onset_and_warn_goes_on(redis_url: str, tmp_path: Path) -> None:
    assert asyncio.run(log_steps(redis_url, tmp_path, {})) is None
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["alarms"] for x in lines] == [
        [],
        [],
        [],
        ["accuracy_cliff[all]@3: validation accuracy 0.450, down 0.150 from 0.600 at step 1"],
        [],
    ]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_guard_stop_ends_the_run_at_the_alarm(redis_url: str, tmp_path: Path) -> None:
    stopped = asyncio.run(
        log_steps(redis_url, tmp_path, {"guard": {"on_alarm": {"accuracy_cliff": "stop"}}})
    )
    assert stopped is not None
    assert str(stopped).startswith("stopped by guard.on_alarm.accuracy_cliff=stop: accuracy_cliff")
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2, 3]  # the alarm's record is written, then stop
    assert lines[-1]["guard"].startswith("stop: accuracy_cliff[all]@3")


def test_guard_actions_are_checked() -> None:
    from marl.spec.run import SpecError

    with pytest.raises(SpecError, match="guard.on_alarm"):
        parse_spec({"guard": {"on_alarm": {"accuracy_cliff": "pause"}}})


def test_run_record_keeps_every_alarm_and_a_resume_replays_the_kept_ones(
    redis_url: str, tmp_path: Path
) -> None:
    assert asyncio.run(log_steps(redis_url, tmp_path, {})) is None
    cliff = "accuracy_cliff[all]@3: validation accuracy 0.450, down 0.150 from 0.600 at step 1"

    async def record_alarms() -> list[str]:
        r = streams.connect(redis_url)
        try:
            record = await RunStore(r).get("run-1")
        finally:
            await r.aclose()
        assert record is not None
        return list(json.loads(record["alarms_json"]))

    assert asyncio.run(record_alarms()) == [f"step 3: {cliff}"]

    async def resume(step: int) -> list[str]:
        r = streams.connect(redis_url)
        model = Path(marl.__file__).parent / "assets" / "demo-model"
        spec = parse_spec({"workflow": "voting", "model": {"path": str(model)}})
        executor = RunExecutor("run-1", spec, tmp_path, r, RunStore(r), "learner-2", takeover=1,
                               learner=LearnerConfig())
        try:
            executor.records.jsonl.cut_back(step)
            await executor.records.replay(executor.records.jsonl.records())
            # the watch goes on from the kept records: the cliff is firing, not new, at step 4
            fired = executor.records.alarms.update({"step": 4, "val/accuracy": 0.4})
        finally:
            await r.aclose()
        return [str(a) for a in fired]

    assert asyncio.run(resume(3)) == []
    assert asyncio.run(record_alarms()) == [f"step 3: {cliff}"]
    # cut back before the cliff: the record forgets it, and step 4 is its onset now
    assert asyncio.run(resume(2)) == [
        "accuracy_cliff[all]@4: validation accuracy 0.400, down 0.200 from 0.600 at step 1"
    ]
    assert asyncio.run(record_alarms()) == []
