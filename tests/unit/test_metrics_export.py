"""The TensorBoard sink writes event files TensorBoard itself reads back, per-role scalars included."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from marl.runtime.metric_sinks import TensorBoardSink, extra_sinks, scalars
from marl.spec.run import parse_spec


def test_scalars_keep_numbers_only() -> None:
    record = {"step": 3, "role/generator/chi2": 0.5, "alarms": ["x"], "ok": True, "n": 2}
    assert scalars(record) == {"role/generator/chi2": 0.5, "n": 2.0}


def test_tensorboard_event_file_has_per_role_scalars_and_alarms(tmp_path: Path) -> None:
    sink = TensorBoardSink(tmp_path / "tensorboard")
    records = [
        {"step": 1, "role/generator/chi2": 0.01, "role/aggregator/chi2": 0.02, "alarms": []},
        {
            "step": 2,
            "role/generator/chi2": 0.04,
            "role/aggregator/chi2": 0.02,
            "val/accuracy": 0.5,
            "alarms": ["accuracy_cliff[all]@2: validation accuracy 0.500"],
        },
    ]

    async def write() -> None:
        for r in records:
            await sink.write(int(r["step"]), r)  # type: ignore[call-overload]
        await sink.close()

    asyncio.run(write())
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = events.Tags()
    assert {"role/generator/chi2", "role/aggregator/chi2", "val/accuracy"} <= set(tags["scalars"])
    chi2 = [(e.step, round(e.value, 6)) for e in events.Scalars("role/generator/chi2")]
    assert chi2 == [(1, 0.01), (2, 0.04)]
    assert [e.step for e in events.Scalars("val/accuracy")] == [2]
    (alarm,) = events.Tensors("alarms/text_summary")
    assert alarm.step == 2
    assert alarm.tensor_proto.string_val == [b"accuracy_cliff[all]@2: validation accuracy 0.500"]


def test_logging_section_chooses_the_sinks(tmp_path: Path) -> None:
    assert [type(s).__name__ for s in extra_sinks(parse_spec({}), tmp_path, "r-1")] == [
        "TensorBoardSink"
    ]
    off = parse_spec({"logging": {"tensorboard": False}})
    assert extra_sinks(off, tmp_path, "r-1") == []
