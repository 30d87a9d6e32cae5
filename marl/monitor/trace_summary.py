"""Where each training step's time went, read from a trace directory (`marl.runtime.tracing`).

The learner's spans give a step's phases: waiting for its rollouts, the update, the push
(or, one step ahead, the snapshot) and the rest. The wait is split by what the other
services did during it: **generation** while an inference replica ran a prefill or a
decode step (on vLLM: while it held a request), **reward** while a worker scored an answer
and no replica was generating, and **queueing** for the rest: tasks through Redis to the
workers, requests through gRPC to a replica, a replica gathering a burst, rollouts back
through Redis to the learner.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Interval = tuple[float, float]

GENERATION_SPANS = ("prefill", "decode", "engine request")
"""An inference engine at work: the transformers engine's forwards; for vLLM, whose steps
run out of marl's sight, the time it holds a request (services/inference/vllm_engine.py)."""
REWARD_SPANS = ("score",)
"""A worker scoring an episode's answer (services/workflow/worker.py)."""


def load(trace_dir: Path) -> list[dict[str, Any]]:
    """Every event of every process's file (a line cut short by a killed process is
    skipped)."""
    events = []
    for path in sorted(trace_dir.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events


def write_chrome_trace(events: list[dict[str, Any]], out: Path) -> None:
    """The events (`load`) as one Chrome trace file, for Perfetto or chrome://tracing."""
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def union(intervals: list[Interval]) -> list[Interval]:
    """The intervals merged: sorted, disjoint."""
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Two sorted, disjoint interval lists' common part."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def minus(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Sorted, disjoint `a` without the parts in sorted, disjoint `b`."""
    out = []
    j = 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > start:
                out.append((start, b[k][0]))
            start = max(start, b[k][1])
            k += 1
        if start < end:
            out.append((start, end))
    return out


def length(intervals: list[Interval]) -> float:
    return sum(end - start for start, end in intervals)


@dataclass
class StepTimes:
    """One step's seconds by phase."""

    run: str
    step: int
    start: float
    """Wall-clock seconds the step began (its trace span's start)."""
    step_s: float
    wait: float
    generation: float
    """Of `wait`."""
    reward: float
    """Of `wait`, while nothing generated."""
    update: float
    push: float
    flight: float
    """Seconds its rollouts were in flight: its tasks leaving for the workers to its last
    rollout in (a synchronous step's next tasks leave before it begins, while the previous
    step's record is written; without a flight span, the wait)."""
    flight_generation: float
    """Of `flight`, seconds a replica generated."""

    @property
    def queueing(self) -> float:
        """The rest of `wait`."""
        return self.wait - self.generation - self.reward

    @property
    def other(self) -> float:
        return self.step_s - self.wait - self.update - self.push


def _interval(event: dict[str, Any]) -> Interval:
    start = event["ts"] / 1e6
    return start, start + event["dur"] / 1e6


def step_times(events: list[dict[str, Any]]) -> list[StepTimes]:
    """Every traced training step, in (run, step) order."""
    generation = union([_interval(e) for e in events if e.get("name") in GENERATION_SPANS])
    reward = union([_interval(e) for e in events if e.get("name") in REWARD_SPANS])
    reward_only = minus(reward, generation)
    phases: dict[tuple[str, int], dict[str, Interval]] = {}
    for e in events:
        if e.get("ph") != "X" or "step" not in e.get("args", {}) or "run" not in e["args"]:
            continue
        if e["name"] in ("step", "rollout wait", "rollout flight", "update", "push"):
            key = (e["args"]["run"], int(e["args"]["step"]))
            phases.setdefault(key, {})[e["name"]] = _interval(e)
    out = []
    for (run, step), p in sorted(phases.items()):
        if "step" not in p or "rollout wait" not in p:
            continue  # a step cut short (a cancelled run)
        window = [p["rollout wait"]]
        flight = [p.get("rollout flight", p["rollout wait"])]
        out.append(StepTimes(
            run, step, p["step"][0], length([p["step"]]), length(window),
            length(intersect(window, generation)), length(intersect(window, reward_only)),
            length([p["update"]]) if "update" in p else 0.0,
            length([p["push"]]) if "push" in p else 0.0,
            length(flight), length(intersect(flight, generation)),
        ))
    return out


def steps_per_s(steps: list[StepTimes]) -> float:
    """Steps a wall-clock second: each run's steps from its first one's start to its last
    one's, so the time between a step's span and the next (its record being written, which
    a synchronous run overlaps with the next step's rollouts) counts too."""
    done, seconds = 0, 0.0
    by_run: dict[str, list[float]] = {}
    for s in steps:
        by_run.setdefault(s.run, []).append(s.start)
    for starts in by_run.values():
        done += len(starts) - 1
        seconds += max(starts) - min(starts)
    return done / seconds if seconds > 0 else 0.0


def shares(steps: list[StepTimes]) -> dict[str, float]:
    """Each phase's share of the steps' summed time."""
    total = sum(s.step_s for s in steps) or 1.0
    return {
        name: sum(getattr(s, name) for s in steps) / total
        for name in ("wait", "generation", "reward", "queueing", "update", "push", "other")
    }


def full_collections(events: list[dict[str, Any]]) -> list[tuple[str, float, float]]:
    """Every full (generation 2) garbage collection, each a pause of its process
    (`marl.runtime.tracing`): its service, its start in wall-clock seconds and its milliseconds."""
    service = {e["pid"]: e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "process_name"}
    return [(service.get(e.get("pid"), f"pid {e.get('pid')}"), e["ts"] / 1e6, e["dur"] / 1e3)
            for e in events
            if e.get("ph") == "X" and e.get("name") == "gc"
            and e.get("args", {}).get("generation") == 2]


def collections_between(collections: list[tuple[str, float, float]], start: float,
                        end: float) -> str:
    """Of `full_collections`, those that began between `start` and `end`, by service: how
    many, their total and longest milliseconds ("none" when none did)."""
    by_service: dict[str, list[float]] = {}
    for name, began, ms in collections:
        if start <= began <= end:
            by_service.setdefault(name, []).append(ms)
    if not by_service:
        return "none"
    return "; ".join(f"{name}: {len(ms)} ({sum(ms):.0f} ms, longest {max(ms):.0f})"
                     for name, ms in sorted(by_service.items()))


def report(steps: list[StepTimes], skip: int = 0,
           events: list[dict[str, Any]] | None = None) -> str:
    """A table per run: median milliseconds of each phase over its steps after the first
    `skip`, and each phase's share of the step time; last, the median flight of a step's
    rollouts (`StepTimes.flight`, which may begin before the step does: no share). With
    the trace's `events`, then the full garbage collections during those steps."""
    lines = []
    collections = None if events is None else full_collections(events)
    by_run: dict[str, list[StepTimes]] = {}
    for s in steps:
        if s.step > skip:
            by_run.setdefault(s.run, []).append(s)
    head = ("step", "wait", "generation", "reward", "queueing", "update", "push", "other",
            "flight")
    for run, of_run in by_run.items():
        lines.append(f"run {run}: {len(of_run)} steps after the first {skip}")
        lines.append("           " + "".join(f"{h:>11}" for h in head))
        medians = [statistics.median(getattr(s, "step_s" if h == "step" else h) for s in of_run)
                   for h in head]
        lines.append("median ms  " + "".join(f"{1000 * m:>11.1f}" for m in medians))
        share = shares(of_run)
        lines.append("share      " + f"{1.0:>11.2f}"
                     + "".join(f"{share[h]:>11.2f}" for h in head[1:-1]))
        if collections is not None:
            start = min(s.start for s in of_run)
            end = max(s.start + s.step_s for s in of_run)
            lines.append("full garbage collections: "
                         + collections_between(collections, start, end))
    return "\n".join(lines)
