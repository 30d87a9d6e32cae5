"""marl.runtime.tracing: a process's spans as Chrome trace events in its own file."""

from __future__ import annotations

import gc
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from marl.runtime import tracing
from marl.runtime.tracing import LANE_TIDS, LANES_PER_GROUP, Tracer


def events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_span_is_a_complete_event_in_wall_clock_microseconds(tmp_path: Path) -> None:
    path = tmp_path / "learner-1.jsonl"
    tracer = Tracer(path, "learner")
    before = time.time()
    with tracer.span("update", run="r", step=3):
        time.sleep(0.01)
    tracer.add("push", 100.0, 100.25, step=3)
    tracer.close()
    meta, update, push = events(path)
    assert meta == {"ph": "M", "name": "process_name", "pid": os.getpid(),
                    "args": {"name": "learner"}}
    assert update["ph"] == "X" and update["name"] == "update"
    assert update["args"] == {"run": "r", "step": 3}
    assert update["pid"] == os.getpid()
    assert abs(update["ts"] / 1e6 - before) < 1.0
    assert 10_000 <= update["dur"] < 1_000_000
    assert push["dur"] == 250_000
    assert push["ts"] - round((100.0 + time.time() - time.monotonic()) * 1e6) < 100_000


def test_overlapping_spans_of_a_group_take_the_first_free_lane(tmp_path: Path) -> None:
    path = tmp_path / "workflow-1.jsonl"
    tracer = Tracer(path, "workflow")
    tracer.add("episode", 0.0, 2.0, "episodes")
    tracer.add("episode", 1.0, 3.0, "episodes")  # overlaps the first: a second lane
    tracer.add("episode", 2.5, 4.0, "episodes")  # the first lane is free again at 2.0
    tracer.add("score", 0.5, 0.6, "score")  # another group: lanes of its own
    tracer.close()
    spans = [e for e in events(path) if e["ph"] == "X"]
    episodes = LANE_TIDS
    score = LANE_TIDS + LANES_PER_GROUP
    assert [e["tid"] for e in spans] == [episodes, episodes + 1, episodes, score]
    names = {e["tid"]: e["args"]["name"] for e in events(path) if e["name"] == "thread_name"}
    assert names == {episodes: "episodes 0", episodes + 1: "episodes 1", score: "score 0"}


def test_an_unconfigured_process_traces_nothing(tmp_path: Path) -> None:
    tracer = Tracer()
    with tracer.span("update"):
        pass
    tracer.add("push", 0.0, 1.0)
    assert not tracer.on
    assert list(tmp_path.iterdir()) == []


def test_configure_names_the_file_by_service_and_pid(tmp_path: Path) -> None:
    try:
        tracing.configure("inference", str(tmp_path))
        with tracing.span("decode", rows=8):
            pass
        tracing.add("prefill", 0.0, 0.5, rows=8)
    finally:
        tracing.configure("inference", None)
    (path,) = tmp_path.iterdir()
    assert path.name == f"inference-{os.getpid()}.jsonl"
    assert [e["name"] for e in events(path)] == ["process_name", "decode", "prefill"]
    assert not tracing.tracer().on


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_writes_nothing_to_its_parents_file(tmp_path: Path) -> None:
    path = tmp_path / "sandbox-1.jsonl"
    tracer = Tracer(path, "sandbox")
    pid = os.fork()
    if pid == 0:
        tracer.add("job", 0.0, 1.0)
        tracer.close()
        os._exit(0)
    os.waitpid(pid, 0)
    tracer.add("parent", 0.0, 1.0)
    tracer.close()
    assert [e["name"] for e in events(path)] == ["process_name", "parent"]


def test_a_garbage_collection_is_a_span_of_the_process(tmp_path: Path) -> None:
    gc.disable()  # the explicit collections only
    try:
        tracing.configure("learner", str(tmp_path))
        tracing.configure("learner", str(tmp_path))  # once more: still one span a collection
        gc.collect()
        tracing.configure("learner", None)
        gc.collect()  # not traced any more
    finally:
        tracing.configure("learner", None)
        gc.enable()
    path = tmp_path / f"learner-{os.getpid()}.jsonl"
    spans = [e for e in events(path) if e["name"] == "gc"]
    assert len(spans) == 1
    assert spans[0]["args"]["generation"] == 2
    assert spans[0]["dur"] >= 0 and spans[0]["tid"] == threading.get_native_id()
