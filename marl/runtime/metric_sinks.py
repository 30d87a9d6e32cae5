"""Metric sinks for the tools users already read: Prometheus, TensorBoard and W&B.

Each sink takes the same record the learner writes to `metrics.jsonl`
(`{"step": n, "role/<role>/chi2": ..., "alarms": [...]}`) through the learner's sink
interface (`async write(step, record)`, `async close()`), so the per-role series the
paper reads (§A.6.2: per-role metrics, not global ones) show up under the same names
everywhere. Numbers become scalars; the `alarms` list becomes text at its step, so an
alarm is visible on the time axis next to the curves it read.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

from marl.runtime import prometheus_metrics as prom
from marl.spec.run import RunSpec

ALARM_TEXT = re.compile(r"^(?P<mechanism>[a-z_]+)\[(?P<role>[^\]]+)\]@")
"""How an alarm reads in a step record (`marl.diagnostics.alarms.Alarm.__str__`):
`mechanism[role]@step: evidence`."""
RUNS_EXPORTED = 32
"""Runs whose series one learner process keeps on /metrics; the oldest beyond it are
dropped, so that a long-lived learner's scrape stays bounded."""
_EXPORTED: OrderedDict[str, set[str]] = OrderedDict()
"""Run id -> its roles, oldest first: the series this process exports."""


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's numeric fields (bools and the step itself left out)."""
    return {
        k: float(v)
        for k, v in record.items()
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
    }


class TrainingGauges:
    """The run's step records as Prometheus series on the learner's /metrics
    (`marl.runtime.prometheus_metrics`): per run, per role, and alarms by mechanism.
    The series stay after the run ends, so a dashboard shows where it stopped."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self.failed_steps = 0
        _EXPORTED.pop(run_id, None)
        _EXPORTED[run_id] = set()
        while len(_EXPORTED) > RUNS_EXPORTED:
            old, roles = _EXPORTED.popitem(last=False)
            _forget(old, roles)

    async def write(self, step: int, record: dict[str, Any]) -> None:
        run = self.run_id
        prom.RUN_STEP.labels(run).set(step)
        if "train/reward_mean" in record:
            prom.RUN_REWARD_MEAN.labels(run).set(float(record["train/reward_mean"]))
        if "val/accuracy" in record:
            prom.RUN_VAL_ACCURACY.labels(run).set(float(record["val/accuracy"]))
        self.failed_steps += int(bool(record.get("train/failed_step", 0)))
        prom.RUN_FAILED_STEPS.labels(run).set(self.failed_steps)
        roles = _EXPORTED.setdefault(run, set())
        for key, value in record.items():
            parts = key.split("/")
            if len(parts) == 3 and parts[0] == "role" and parts[2] in prom.ROLE_SERIES:
                prom.ROLE_SERIES[parts[2]].labels(run, parts[1]).set(float(value))
                roles.add(parts[1])
        for alarm in record.get("alarms") or []:
            found = ALARM_TEXT.match(str(alarm))
            if found is not None:
                prom.ALARMS.labels(run, found["role"], found["mechanism"]).inc()
                roles.add(found["role"])

    async def close(self) -> None:
        pass


def _forget(run: str, roles: set[str]) -> None:
    for gauge in prom.RUN_SERIES:
        try:
            gauge.remove(run)
        except KeyError:
            pass
    for role in roles:
        for gauge in prom.ROLE_SERIES.values():
            try:
                gauge.remove(run, role)
            except KeyError:
                pass
    for labels in [m.labels for m in _alarm_samples() if m.labels.get("run") == run]:
        try:
            prom.ALARMS.remove(run, labels["role"], labels["mechanism"])
        except KeyError:
            pass


def _alarm_samples() -> list[Any]:
    return [s for family in prom.ALARMS.collect() for s in family.samples
            if s.name == "marl_alarms_total"]


class TensorBoardSink:
    """Event files in RUN_DIR/tensorboard: `tensorboard --logdir RUN_DIR` shows the run.

    A step's scalars go out as one summary event (each a `simple_value`, as
    `SummaryWriter.add_scalar` writes them), not one event apiece: the learner writes
    the record while its update runs on another thread of the same process, and one
    event per scalar (~50 a Single step, more with more roles) meant as many protobufs
    and hand-offs to the writer thread, each holding the interpreter lock."""

    def __init__(self, folder: Path):
        from torch.utils.tensorboard.writer import FileWriter

        self.folder = folder
        self.writer = FileWriter(str(folder))

    async def write(self, step: int, record: dict[str, Any]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard.summary import text

        values = [Summary.Value(tag=k, simple_value=v) for k, v in scalars(record).items()]
        self.writer.add_summary(Summary(value=values), step)
        for alarm in record.get("alarms") or []:
            self.writer.add_summary(text("alarms", str(alarm)), step)
        self.writer.flush()

    async def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A W&B run with the RunSpec as its config; offline mode writes RUN_DIR/wandb."""

    def __init__(self, spec: RunSpec, run_dir: Path, run_id: str):
        assert spec.logging.wandb is not None
        try:
            import wandb
        except ImportError:
            raise ValueError(
                "logging.wandb is set but wandb is not installed: `pip install marl[wandb]`, "
                "or remove logging.wandb"
            ) from None
        cfg = spec.logging.wandb
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            mode=cfg.mode,
            name=run_id,
            id=run_id,
            dir=str(run_dir),
            config=spec.model_dump(mode="json"),
            resume="allow",
            settings=wandb.Settings(silent=True, console="off"),
        )

    async def write(self, step: int, record: dict[str, Any]) -> None:
        data: dict[str, Any] = dict(scalars(record))
        if record.get("alarms"):
            data["alarms"] = "; ".join(str(a) for a in record["alarms"])
        self.run.log(data, step=step)

    async def close(self) -> None:
        self.run.finish()


def extra_sinks(spec: RunSpec, run_dir: Path, run_id: str) -> list[Any]:
    """The Prometheus gauges, and the sinks `logging` asks for, in addition to metrics.jsonl
    and the run record."""
    sinks: list[Any] = [TrainingGauges(run_id)]
    if spec.logging.tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard"))
    if spec.logging.wandb is not None:
        sinks.append(WandbSink(spec, run_dir, run_id))
    return sinks
