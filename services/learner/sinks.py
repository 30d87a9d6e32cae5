"""Where a step's record goes: a sink takes one record per logged step and is closed when
the run ends. The run writes to every sink in order; a new sink (TensorBoard, alarms) is
one class with `write` and `close`. `RolloutLog` keeps a few whole transcripts a step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

import redis.asyncio as aioredis

from marl.rollout import Rollout, to_json
from marl.runtime import streams
from services.learner.outcome import Outcome
from services.learner.runs import RunStore


class MetricsSink(Protocol):
    async def write(self, step: int, record: dict[str, Any]) -> None: ...

    async def close(self) -> None: ...


class JsonlSink:
    """`metrics.jsonl`, one JSON object per line: the run's record on disk."""

    def __init__(self, path: Path):
        self.path = path

    def cut_back(self, step: int | None) -> None:
        """A resumed run starts again after `step` (None: from scratch): later lines go."""
        if not self.path.exists():
            return
        keep = []
        if step is not None:
            for line in self.path.read_text().splitlines():
                if line.strip() and json.loads(line)["step"] <= step:
                    keep.append(line + "\n")
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(keep))
        tmp.replace(self.path)

    def records(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    async def write(self, step: int, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    async def close(self) -> None:
        pass


class RunRecordSink:
    """The run's record in Redis: its step, last metrics, every alarm and guard action
    so far ("step N: ...") and its failed steps and episodes (`outcome`), for GetRun and
    `marl status`."""

    def __init__(self, store: RunStore, run_id: str):
        self.store = store
        self.run_id = run_id
        self.alarms: list[str] = []
        self.outcome = Outcome()

    def _note(self, record: dict[str, Any]) -> None:
        self.outcome.note(record)
        step = record["step"]
        self.alarms += [f"step {step}: {a}" for a in record.get("alarms") or []]
        if record.get("guard"):
            self.alarms.append(f"step {step}: guard {record['guard']}")

    async def restore(self, records: list[dict[str, Any]]) -> None:
        """A resumed run: the alarms of the records it keeps, and none of those cut back."""
        self.alarms = []
        self.outcome = Outcome()
        for record in records:
            self._note(record)
        await self.store.update(
            self.run_id, alarms_json=json.dumps(self.alarms), **self.outcome.fields()
        )

    async def note_unlogged(self, episodes: int, failed: int, failed_step: bool) -> None:
        """Count a step that ends the run before it is logged."""
        self.outcome.add(episodes, failed, failed_step)
        await self.store.update(self.run_id, **self.outcome.fields())

    async def write(self, step: int, record: dict[str, Any]) -> None:
        self._note(record)
        await self.store.update(
            self.run_id,
            step=step,
            last_metrics_json=json.dumps(record),
            alarms_json=json.dumps(self.alarms),
            **self.outcome.fields(),
        )

    async def close(self) -> None:
        pass


class StreamSink:
    """The run's metrics stream in Redis, which WatchRun follows."""

    def __init__(self, r: aioredis.Redis, run_id: str):
        self.r = r
        self.stream = streams.metrics_stream(run_id)

    async def cut_back(self, step: int | None) -> None:
        """Drop entries past `step` (all of them for None), so a watcher from the start sees
        each step once after a resume."""
        await streams.delete_matching(
            self.r, self.stream, lambda record: step is None or record["step"] > step
        )

    async def write(self, step: int, record: dict[str, Any]) -> None:
        await self.r.xadd(self.stream, {"json": json.dumps(record)})

    async def close(self) -> None:
        pass


class RolloutLog:
    """A few whole transcripts per step, for reading what each role actually says: evenly
    spaced over the step's rollouts, and the first failed one whenever the step has one
    and none of those failed (its `error` says why; `train/episode_errors` counts them)."""

    def __init__(self, folder: Path, per_step: int):
        self.folder = folder
        self.per_step = per_step

    def write(self, step: int, rollouts: list[Rollout]) -> None:
        if self.per_step == 0:
            return
        self.folder.mkdir(exist_ok=True)
        picked = rollouts[:: max(1, len(rollouts) // self.per_step)][: self.per_step]
        failed = next((r for r in rollouts if r.error is not None), None)
        if failed is not None and all(r.error is None for r in picked):
            picked[-1] = failed
        with open(self.folder / f"step_{step:06d}.jsonl", "w") as f:
            for r in picked:
                f.write(to_json(r) + "\n")
