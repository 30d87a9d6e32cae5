"""Metric sinks for the tools users already read: TensorBoard and Weights & Biases.

Each sink takes the same record the learner writes to `metrics.jsonl`
(`{"step": n, "role/<role>/chi2": ..., "alarms": [...]}`) through the learner's sink
interface (`async write(step, record)`, `async close()`), so the per-role series the
paper reads (§A.6.2: per-role metrics, not global ones) show up under the same names
everywhere. Numbers become scalars; the `alarms` list becomes text at its step, so an
alarm is visible on the time axis next to the curves it read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from marl.spec.run import RunSpec


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's numeric fields (bools and the step itself left out)."""
    return {
        k: float(v)
        for k, v in record.items()
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
    }


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
    """The sinks `logging` asks for, in addition to metrics.jsonl and the run record."""
    sinks: list[Any] = []
    if spec.logging.tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard"))
    if spec.logging.wandb is not None:
        sinks.append(WandbSink(spec, run_dir, run_id))
    return sinks
