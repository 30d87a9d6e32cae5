"""Planted role drift: a Voting-SP run whose reward pays the aggregator for the generators'
long-form idiom fires `sp_role_capture` on the aggregator before validation accuracy falls;
the matched plain Voting-SP run fires no alarm at all; a Voting-IP run whose generator
adapter trains at 20x the learning rate of the aggregator's fires `gradient_amplification`
on the generator. Every service a process, the shipped demo model (it answers in the terse
`\\boxed{N}` stamp or the long form "The answer is N").

Alarms are read twice: as the learner logged them in metrics.jsonl while the run went, and
from the run directory the way `marl report` re-evaluates them (thresholds from the run's
spec).
Measured (2026-12-06, 10 steps, the demo model taught Voting's stamp): the planted run's
aggregator terse rate went 0.31 -> 0.30 (step 4) -> 0.16 (step 5: capture, 30 % of its
first value lost) -> 0.04 while validation accuracy went 0.14 -> 0.38 -> 0.42.
Measured (12:50 UTC, 10 steps): the plain Voting-SP and Voting-IP demo runs fire nothing
(validation 0 -> 0.72). Slow (`make test-drift`): three 10-step runs.

The raised learning rate ramps up over 8 warmup steps (every adapter's does). The ramp is
what makes the generator's χ² rise whatever tokens get sampled: a constant 1e-2 left it where the
run's sampling took it, and the engine samples by inverse CDF, so a host whose matmuls
round differently samples other tokens. Seed 1 at a constant 1e-2 went 0.09 -> 1.26 ->
34.45 on one host (the alarm fired) and stayed within 0.09-0.30 on another (2026-12-01,
an Intel AVX-512 host: no alarm, CI failed); on that host a constant 3e-2 fired on 1 of
seeds 0-3 (the generator's entropy collapsed on 2). With the ramp to 2e-2, seeds 0-3 there
all fired, at 74.8x, 18.5x, 8.7x and 4.4x the generator's first χ² (the threshold 3x),
the aggregator's at 1.0x: its χ² stays under the 0.02 noise floor at 1e-3. On an AMD Zen 4
host (2026-12-07) seed 0 did not fire: one sampled token put the generator's step-2 χ² at
1.05, and the first window's mean (0.38) hid the rise to 0.48. Seeds 1-3 fired there
(update_chi2 6.2x, 3.9x, 3.5x), so the run takes seed 1, the one with most room on both
hosts. The alarm's arithmetic is tested on its own in tests/unit/test_alarms.py.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import yaml

from marl.diagnostics.rundir import load_run
from marl.local.launcher import Cluster
from marl.models.demo import demo_model_dir
from marl.protocol.v1 import learner_pb2, learner_pb2_grpc
from tests.support.drift import RUNS, spec

pytestmark = [pytest.mark.slow, pytest.mark.drift, pytest.mark.timeout(1500)]

@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("planted")
    cluster = Cluster(base / "cluster", str(demo_model_dir()), engine="transformers")
    cluster.start()
    out: dict[str, Path] = {}
    try:
        stub = learner_pb2_grpc.LearnerStub(grpc.insecure_channel(cluster.endpoints()["learner"]))
        for name, overrides in RUNS.items():
            out[name] = base / name
            text = yaml.safe_dump(spec(out[name], overrides))
            run_id = stub.SubmitRun(learner_pb2.SubmitRunRequest(spec_yaml=text), timeout=60).run_id
            req = learner_pb2.WatchRunRequest(run_id=run_id, from_start=True)
            for _ in stub.WatchRun(req, timeout=1200):
                pass
            run = stub.GetRun(learner_pb2.GetRunRequest(run_id=run_id), timeout=10)
            assert run.state == "SUCCEEDED", run.error
    finally:
        cluster.stop()
    return out


def test_planted_aggregator_capture_fires_before_accuracy_falls(runs: dict[str, Path]) -> None:
    run = load_run(runs["planted"])
    capture = [a for a in run.alarms if a.mechanism == "sp_role_capture"]
    assert capture, [str(a) for a in run.alarms]
    assert {a.role for a in capture} == {"aggregator"}
    terse = [a for a in capture if a.evidence.startswith("terse rate")]
    assert terse, [str(a) for a in capture]  # the slot lost its stamp (Table 5, Panel A3)
    first = min(a.step for a in capture)
    cliffs = [a for a in run.alarms if a.mechanism == "accuracy_cliff"]
    assert all(c.step > first for c in cliffs)
    # the learner said so while the run went, in metrics.jsonl's `alarms`
    logged = [text for _, text in run.logged_alarms]
    assert any(t.startswith("sp_role_capture[aggregator]") and "terse rate" in t for t in logged)


def test_matched_run_fires_nothing(runs: dict[str, Path]) -> None:
    run = load_run(runs["matched"])
    assert [str(a) for a in run.alarms] == []
    assert run.logged_alarms == []


def test_raised_generator_lr_fires_gradient_amplification_on_the_generator(
    runs: dict[str, Path],
) -> None:
    run = load_run(runs["generator_lr"])
    amplification = [a for a in run.alarms if a.mechanism == "gradient_amplification"]
    assert amplification, [str(a) for a in run.alarms]
    assert {a.role for a in amplification} == {"generator"}
    logged = [text for _, text in run.logged_alarms]
    assert any(t.startswith("gradient_amplification[generator]") for t in logged)
