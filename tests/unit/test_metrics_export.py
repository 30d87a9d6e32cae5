"""The metric sinks: TensorBoard event files TensorBoard itself reads back, the Prometheus
gauges of the learner's /metrics, and a W&B offline run, per-role series included."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from marl.runtime import metric_sinks
from marl.runtime.metric_sinks import TensorBoardSink, TrainingGauges, extra_sinks, scalars
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
        "TrainingGauges", "TensorBoardSink"
    ]
    off = parse_spec({"logging": {"tensorboard": False}})
    assert [type(s).__name__ for s in extra_sinks(off, tmp_path, "r-1")] == ["TrainingGauges"]


def write_all(sink: Any, records: list[dict[str, Any]]) -> None:
    async def write() -> None:
        for r in records:
            await sink.write(int(r["step"]), r)
        await sink.close()

    asyncio.run(write())


def sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def test_training_gauges_per_run_and_role_and_alarms_by_mechanism() -> None:
    write_all(TrainingGauges("gauges-1"), [
        {"step": 0, "val/accuracy": 0.125, "alarms": []},
        {"step": 1, "train/reward_mean": 0.25, "train/failed_step": 1,
         "role/generator/chi2_token": 0.5, "role/generator/update_chi2": 0.0625,
         "role/generator/entropy": 1.5, "role/generator/response_len_mean": 7.0,
         "role/aggregator/entropy": 0.75, "policy/shared/chi2_token": 9.0,
         "alarms": ["entropy_collapse[aggregator]@1: entropy 0.750 < 0.8",
                    "accuracy_cliff[all]@1: validation accuracy 0.1"]},
        {"step": 2, "train/reward_mean": 0.5, "train/failed_step": 0, "val/accuracy": 0.375,
         "role/generator/chi2_token": 0.25,
         "alarms": ["entropy_collapse[aggregator]@2: entropy 0.700 < 0.8"]},
    ])
    run = {"run": "gauges-1"}
    assert sample("marl_run_step", **run) == 2
    assert sample("marl_run_reward_mean", **run) == 0.5
    assert sample("marl_run_val_accuracy", **run) == 0.375
    assert sample("marl_run_failed_steps", **run) == 1
    assert sample("marl_role_chi2_token", role="generator", **run) == 0.25
    assert sample("marl_role_update_chi2", role="generator", **run) == 0.0625
    assert sample("marl_role_entropy", role="generator", **run) == 1.5
    assert sample("marl_role_entropy", role="aggregator", **run) == 0.75
    assert sample("marl_role_response_len", role="generator", **run) == 7.0
    assert sample("marl_role_chi2_token", role="shared", **run) is None  # a policy, not a role
    assert sample("marl_alarms_total", role="aggregator", mechanism="entropy_collapse", **run) == 2
    assert sample("marl_alarms_total", role="all", mechanism="accuracy_cliff", **run) == 1


def test_training_gauges_keep_a_bounded_number_of_runs() -> None:
    first = "bounded-0"
    for i in range(metric_sinks.RUNS_EXPORTED + 1):
        write_all(TrainingGauges(f"bounded-{i}"), [
            {"step": 1, "role/generator/entropy": 1.0,
             "alarms": ["entropy_collapse[generator]@1: entropy low"]}])
    assert sample("marl_run_step", run=first) is None
    assert sample("marl_role_entropy", run=first, role="generator") is None
    assert sample("marl_alarms_total", run=first, role="generator",
                  mechanism="entropy_collapse") is None
    assert sample("marl_run_step", run=f"bounded-{metric_sinks.RUNS_EXPORTED}") == 1


WANDB_BLOCK = 32768


def wandb_records(path: Path) -> Iterator[bytes]:
    """The protobuf records of a W&B transaction log (`run-ID.wandb`): a 7-byte header
    (`:W&B`, magic, version), then leveldb-log framing in 32 KiB blocks: per fragment a
    4-byte checksum, a 2-byte little-endian length and a type (1 full, 2 first, 3 middle,
    4 last)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, record = 7, b""
    while pos + 7 <= len(data):
        left = WANDB_BLOCK - pos % WANDB_BLOCK
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if left < 7 or (length == 0 and kind == 0):  # the rest of a block is padding
            pos += left
            continue
        record += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            yield record
            record = b""


def test_wandb_offline_run_holds_the_runs_metrics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    from wandb.proto import wandb_internal_pb2

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_SILENT", "true")
    spec = parse_spec({"logging": {"tensorboard": False,
                                   "wandb": {"project": "marl-test", "mode": "offline"}}})
    (sink,) = [s for s in extra_sinks(spec, tmp_path / "run", "wb-1") if
               type(s).__name__ == "WandbSink"]
    write_all(sink, [
        {"step": 1, "train/reward_mean": 0.25, "role/generator/chi2_token": 0.5, "alarms": []},
        {"step": 2, "train/reward_mean": 0.5, "val/accuracy": 0.375,
         "alarms": ["accuracy_cliff[all]@2: validation accuracy 0.375"]},
    ])
    (log,) = (tmp_path / "run" / "wandb").glob("offline-run-*-wb-1/run-wb-1.wandb")
    # wandb's service process writes the file: on a loaded host its last records can land
    # a moment after finish() returns
    deadline = time.monotonic() + 30
    while True:
        history, config = [], {}
        for data in wandb_records(log):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                         for i in record.history.item}
                history.append({k: v for k, v in items.items()
                                if k not in ("_runtime", "_timestamp")})
            if record.WhichOneof("record_type") == "run":
                config = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                          for i in record.run.config.update}
        if len(history) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert history == [
        {"_step": 1, "train/reward_mean": 0.25, "role/generator/chi2_token": 0.5},
        {"_step": 2, "train/reward_mean": 0.5, "val/accuracy": 0.375,
         "alarms": "accuracy_cliff[all]@2: validation accuracy 0.375"},
    ]
    assert config["logging"]["wandb"]["project"] == "marl-test"  # the RunSpec is its config
