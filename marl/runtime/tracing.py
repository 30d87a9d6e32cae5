"""Spans of work in every service process, for one timeline of a step across processes.

A service started with `marl serve ... --trace-dir DIR` (the launcher's
`Cluster(trace_dir=...)`, `marl up --trace DIR`, `marl demo --trace` into OUT/trace) appends
what it does to `DIR/<service>-<pid>.jsonl`, one Chrome trace event a line: a complete event
("ph": "X") with its name, start and duration in microseconds of wall-clock time, the
process, a lane and the span's arguments (the step, the rows of a decode step...).
`marl trace DIR` merges the files into one `trace.json` that Perfetto (ui.perfetto.dev) or
chrome://tracing opens, and prints where each step's time went (`marl.monitor.trace_summary`).

A traced process's garbage collections are spans too ("gc": the generation and how many
objects it freed), on the thread they paused: every thread of the process waits for one.

Spans that overlap on one thread (a worker's episodes, a replica's GenerateMany calls)
are given lanes of their own, so that each lane's spans nest as the format wants.

Processes on one machine share its wall clock; across machines, spans are as far apart as
the machines' clocks are. A process that is not configured traces nothing, and `span`
and `add` then cost one attribute check.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

LANE_TIDS = 1 << 30
"""Thread ids of lanes start here, above any real thread id of a process."""
LANES_PER_GROUP = 1 << 16


class Tracer:
    """Writes one process's spans to its file (None: writes nothing)."""

    def __init__(self, path: Path | None = None, service: str = ""):
        self.on = path is not None
        self._pid = os.getpid()
        """A forked child (the sandbox's jobs, say) writes nothing to its parent's file."""
        self._file: TextIO | None = None
        self._lock = threading.Lock()
        self._lanes: dict[str, list[float]] = {}
        """Per group of overlapping spans: the end of the last span in each lane."""
        self._groups: dict[str, int] = {}
        self._wall_offset = time.time() - time.monotonic()
        self._collections: deque[tuple[float, float, int, int, int]] = deque(maxlen=4096)
        """Garbage collections not yet written: (start, end, thread, generation, collected);
        a process that writes no span for long keeps only the latest."""
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            # a line a write: a killed process loses no span, a forked child holds none
            self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
            self._write({"ph": "M", "name": "process_name", "pid": self._pid,
                         "args": {"name": service}})

    def add(self, name: str, start: float, end: float, lane: str | None = None,
            **args: Any) -> None:
        """A span from `start` to `end` (time.monotonic() seconds). `lane`: the group of
        spans that may overlap on one thread; each gets the first lane of the group free
        at its start."""
        if not self.on or os.getpid() != self._pid:
            return
        with self._lock:
            tid = threading.get_native_id() if lane is None else self._lane(lane, start, end)
            self._write_span(name, start, end, tid, args)
            self._write_collections()

    def collected(self, start: float, end: float, generation: int, collected: int) -> None:
        """A garbage collection, from the collector's callback: kept, and written with the
        next span. Writing it here could re-enter a write that the collection interrupted
        (the tracer's lock, the file's buffer)."""
        if self.on and os.getpid() == self._pid:
            self._collections.append(
                (start, end, threading.get_native_id(), generation, collected))

    def _write_collections(self) -> None:
        while self._collections:
            start, end, tid, generation, collected = self._collections.popleft()
            self._write_span("gc", start, end, tid,
                             {"generation": generation, "collected": collected})

    def _write_span(self, name: str, start: float, end: float, tid: int,
                    args: dict[str, Any]) -> None:
        self._write({
            "ph": "X", "name": name, "pid": self._pid, "tid": tid,
            "ts": round((start + self._wall_offset) * 1e6),
            "dur": round((end - start) * 1e6), "args": args,
        })

    def _lane(self, group: str, start: float, end: float) -> int:
        """The thread id of the first lane of `group` free at `start` (a new one, named
        `<group> <k>`, when none is)."""
        if group not in self._lanes:
            self._lanes[group] = []
            self._groups[group] = len(self._groups)
        ends = self._lanes[group]
        k = next((i for i, e in enumerate(ends) if e <= start), len(ends))
        tid = LANE_TIDS + LANES_PER_GROUP * self._groups[group] + k
        if k == len(ends):
            ends.append(end)
            self._write({"ph": "M", "name": "thread_name", "pid": self._pid, "tid": tid,
                         "args": {"name": f"{group} {k}"}})
        else:
            ends[k] = end
        return tid

    @contextmanager
    def span(self, name: str, lane: str | None = None, **args: Any) -> Iterator[None]:
        """The enclosed work as a span (recorded when it ends, whether it raised or not)."""
        if not self.on:
            yield
            return
        start = time.monotonic()
        try:
            yield
        finally:
            self.add(name, start, time.monotonic(), lane, **args)

    def _write(self, event: dict[str, Any]) -> None:
        assert self._file is not None
        self._file.write(json.dumps(event, separators=(",", ":")) + "\n")

    def close(self) -> None:
        with self._lock:
            if self._file is not None and os.getpid() == self._pid:
                self._write_collections()
                self._file.close()
                self._file = None
            self.on = False


_tracer = Tracer()
"""This process's tracer, as `logging` keeps its root logger: off until `configure`."""


def configure(service: str, trace_dir: str | None) -> None:
    """Trace this process as `service` into `trace_dir` (None: trace nothing), its
    garbage collections included."""
    global _tracer
    _tracer.close()
    path = None if trace_dir is None else Path(trace_dir) / f"{service}-{os.getpid()}.jsonl"
    _tracer = Tracer(path, service)
    if _trace_collection not in gc.callbacks:
        gc.callbacks.append(_trace_collection)


_collection_started = 0.0


def _trace_collection(phase: str, info: dict[str, int]) -> None:
    """A span per garbage collection ("gc", its generation and how many objects it freed)
    on the thread that ran it: a pause of every thread of the process."""
    global _collection_started
    if phase == "start":
        _collection_started = time.monotonic()
    else:
        _tracer.collected(_collection_started, time.monotonic(), info["generation"],
                          info["collected"])


def tracer() -> Tracer:
    return _tracer


def span(name: str, lane: str | None = None, **args: Any) -> Any:
    """`Tracer.span` of this process's tracer."""
    return _tracer.span(name, lane, **args)


def add(name: str, start: float, end: float, lane: str | None = None, **args: Any) -> None:
    """`Tracer.add` of this process's tracer."""
    _tracer.add(name, start, end, lane, **args)


@atexit.register
def _close_at_exit() -> None:
    _tracer.close()
