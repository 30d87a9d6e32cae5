"""The planted-drift runs (tests/integration/test_drift_planted.py, bench/mitigations.py):
a Voting-SP run whose reward pays the aggregator for the generators' long-form idiom, its
matched plain run, and a Voting-IP run whose generator trains at a raised learning rate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from marl.local.demo import DEMO_SPEC
from marl.models.demo import demo_model_dir

PLANTED = "tests.integration.drift_workflows:LONG_AGGREGATOR"
STEPS = 10


RUNS: dict[str, dict[str, Any]] = {
    "planted": {"workflow": PLANTED, "policy": "shared"},
    "matched": {"workflow": "voting", "policy": "shared"},
    "generator_lr": {
        "workflow": "voting",
        "policy": "isolated",
        "seed": 1,
        "optim": {**DEMO_SPEC["optim"], "warmup_steps": 8, "policy_lr": {"generator": 2e-2}},
        # float32 on the CPU: learner and sampler agree (ρ ≈ 1), so the paper's chi2_token
        # stays flat and the χ² that moves is how far the update took the policy
        "alarms": {"chi2_signal": "update_chi2"},
    },
}


def spec(out: Path, overrides: dict[str, Any]) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(yaml.safe_dump(DEMO_SPEC))
    data.update(name="drift", out_dir=str(out), **overrides)
    data["model"] = {"path": str(demo_model_dir())}
    data["train"].update(steps=STEPS, val_interval=5, val_problems=50)
    return data
