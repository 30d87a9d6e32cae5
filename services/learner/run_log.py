"""A run's record-keeping: each step's record goes through the drift alarms and the guard's
decision, then to every metrics sink; a resumed run's kept records replay through them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from marl.diagnostics.alarms import AlarmWatch
from marl.diagnostics.signatures import parallel_roles
from marl.spec.run import RunSpec
from services.learner.guard import Action, Guard, GuardStopped
from services.learner.runs import RunStore
from services.learner.sinks import JsonlSink, MetricsSink, RolloutLog, RunRecordSink, StreamSink


class RunLog:
    def __init__(
        self,
        run_id: str,
        spec: RunSpec,
        out_dir: Path,
        r: aioredis.Redis,
        store: RunStore,
        *,
        roles: dict[str, str],
        spares: dict[str, str],
        extra_sinks: list[MetricsSink] | None = None,
    ):
        """`roles`: role -> adapter, whether adapters are shared decides which alarms apply;
        `spares`: the adapters a split would give a role (guard.py)."""
        self.jsonl = JsonlSink(out_dir / "metrics.jsonl")
        self.stream = StreamSink(r, run_id)
        self.record = RunRecordSink(store, run_id)
        self.sinks: list[MetricsSink] = [self.jsonl, self.record, self.stream, *(extra_sinks or [])]
        self.rollouts = RolloutLog(out_dir / "rollouts", spec.train.rollouts_logged)
        adapters = list(roles.values())
        self.alarms = AlarmWatch(
            spec.alarms, len(set(adapters)) < len(adapters), parallel_roles(spec.workflow)
        )
        """Role drift alarms over every logged record (a resumed run replays those kept)."""
        self.guard = Guard(spec, spares=spares)

    def judge(self, step: int, record: dict[str, Any]) -> tuple[dict[str, Any], Action | None]:
        """The step's full record with the alarms it fires, and what the guard does."""
        full = {"step": step, **record}
        fired = self.alarms.update(full)
        full["alarms"] = [str(a) for a in fired]
        return full, self.guard.decide(fired)

    async def write(self, step: int, full: dict[str, Any], action: Action | None) -> None:
        """The record to every sink; a stop the guard called ends the run after it."""
        for sink in self.sinks:
            await sink.write(step, full)
        if action is not None and action.kind == "stop":
            raise GuardStopped(action.alarm, action.why)

    async def replay(self, records: list[dict[str, Any]]) -> None:
        """A resumed run's kept records: the alarm watch and the run's alarm list go on
        from them, as if this learner had logged them."""
        for record in records:
            self.alarms.update(record)
        await self.record.restore(records)

    async def close(self) -> None:
        for sink in self.sinks:
            await sink.close()
