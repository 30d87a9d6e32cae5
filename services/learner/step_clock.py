"""A training step's phases in time: when its tasks left, its rollouts arrived, its update
ended and its adapters were pushed; as the record's `time/` fields and as trace spans."""

from __future__ import annotations

from dataclasses import dataclass

from marl.runtime import tracing


@dataclass
class StepClock:
    """A training step's phases, in time.monotonic() seconds."""

    start: float
    released: float = 0.0
    """When its tasks set off for the workers: before `start` when they were queued ahead."""
    gathered: float = 0.0
    """When its last rollout arrived."""
    updated: float = 0.0
    pushed: float = 0.0
    """When its adapters were pushed (or, one step ahead, snapshotted for the push)."""

    def times(self, burst_s: float | None) -> dict[str, float]:
        """The phases up to the update. `time/rollout_flight_s` runs from the tasks leaving
        to the last rollout arriving, `time/rollout_s` only the part the learner waited."""
        return {
            "time/rollout_s": self.gathered - self.start,
            "time/rollout_flight_s": self.gathered - self.released,
            "time/update_s": self.updated - self.gathered,
            **({} if burst_s is None else {"time/update_burst_s": burst_s}),
        }

    def push_times(self, end: float) -> dict[str, float]:
        return {"time/push_s": self.pushed - self.updated, "time/step_s": end - self.start}

    def trace(self, run: str, step: int, end: float) -> None:
        """The phases as trace spans: the step (up to `end`), its rollout wait, update and
        push (one step ahead: the snapshot), and apart, on a lane of its own, its rollouts'
        flight. `marl.monitor.trace_summary` reads them back."""
        for name, start, stop in (
            ("step", self.start, end),
            ("rollout wait", self.start, self.gathered),
            ("update", self.gathered, self.updated),
            ("push", self.updated, self.pushed),
        ):
            tracing.add(name, start, stop, run=run, step=step)
        tracing.add("rollout flight", self.released, self.gathered, "rollout flight", run=run,
                  step=step)
