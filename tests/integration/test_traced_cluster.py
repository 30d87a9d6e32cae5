"""Tracing a real cluster (`Cluster(trace_dir=...)`, every service a process): each service
writes its spans, and `marl.monitor.trace_summary` splits each step as the learner logged it."""

from __future__ import annotations

from pathlib import Path

import pytest

from marl.local.launcher import Cluster, service_threads
from marl.monitor import trace_summary
from tests.support.runs import rows, submit, wait_end
from tests.support.specs import demo_model_dir, small_spec

pytestmark = pytest.mark.timeout(600)

STEPS, PROBLEMS, GROUP = 3, 4, 4


def test_a_traced_run_splits_every_step_as_the_learner_logged_it(tmp_path: Path) -> None:
    traces = tmp_path / "trace"
    with Cluster(tmp_path / "cluster", str(demo_model_dir()), engine="transformers",
                 sandbox_replicas=0, workflow_replicas=2,
                 threads=service_threads(2, overlapped=False), trace_dir=traces) as cluster:
        out = tmp_path / "run"
        spec = small_spec("traced", out, steps=STEPS, group=GROUP, problems=PROBLEMS)
        run_id = submit(cluster, spec)
        assert wait_end(cluster, run_id).state == "SUCCEEDED"
    assert sorted(p.name.split("-")[0] for p in traces.glob("*.jsonl")) == [
        "inference", "learner", "workflow", "workflow"
    ]
    events = trace_summary.load(traces)
    logged = {r["step"]: r for r in rows(out) if r["step"] > 0}
    steps = trace_summary.step_times(events)
    assert [(s.run, s.step) for s in steps] == [(run_id, k) for k in range(1, STEPS + 1)]
    for s in steps:
        record = logged[s.step]
        assert s.step_s == pytest.approx(record["time/step_s"], abs=1e-3)
        assert s.wait == pytest.approx(record["time/rollout_s"], abs=1e-3)
        assert s.update == pytest.approx(record["time/update_s"], abs=1e-3)
        assert 0 < s.generation < s.wait
        assert s.queueing > 0
        assert s.generation + s.reward + s.queueing == pytest.approx(s.wait)
    # Voting: 3 generator turns and an aggregator turn an episode, validation's included
    episodes = [e for e in events if e["name"] == "episode"]
    train = [e for e in episodes if ":train:" in e["args"]["task"]]
    assert len(train) == STEPS * PROBLEMS * GROUP
    assert all(e["args"]["error"] is None for e in episodes)
    requested = sum(e["args"]["requests"] for e in events if e["name"] == "GenerateMany")
    assert requested == 4 * len(episodes)
    assert sum(e["args"]["rows"] for e in events if e["name"] == "prefill") == requested
