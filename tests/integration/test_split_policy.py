"""Adaptive policy sharing end to end: the planted Voting-SP capture run of
test_drift_planted.py under `guard.on_alarm.sp_role_capture: split`. Every service a process
on a real Redis. At the `sp_role_capture[aggregator]` alarm the aggregator leaves the shared
adapter for a copy of it; the run trains on with two adapters and pushes both to inference
(the aggregator's turns are then served by the new adapter); the learner is SIGKILLed after
the split and another takes the run over from its last checkpoint with the split routing;
the final checkpoint's adapters load in PEFT.

The alarm's thresholds are lowered from the drift test's defaults (terse-rate drop 0.15,
two points) so the split comes in the first half of the run on any host: the planted reward
moves the aggregator's terse rate by ~0.1 a step (test_drift_planted.py's measurement).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from marl.local.demo import DEMO_SPEC
from marl.local.launcher import Cluster
from marl.models.demo import demo_model_dir
from services.learner.runs import acks_key
from tests.support.runs import kill_learner, rows, start_learner, submit, wait_end

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

PLANTED = "tests.integration.drift_workflows:LONG_AGGREGATOR"
STEPS = 10


def split_spec(out: Path) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(yaml.safe_dump(DEMO_SPEC))
    data.update(name="split", out_dir=str(out), workflow=PLANTED, policy="shared")
    data["model"] = {"path": str(demo_model_dir())}
    data["train"].update(
        steps=STEPS, val_interval=5, val_problems=50, checkpoint_interval=1, rollouts_logged=16
    )
    data["alarms"] = {"min_points": 2, "capture_terse_drop": 0.15}
    data["guard"] = {"on_alarm": {"sp_role_capture": "split"}}
    return data


def logged(out: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's records so far; none while a line is half written."""
    try:
        return rows(out)
    except json.JSONDecodeError:
        return []


def split_row(out: Path) -> dict[str, Any] | None:
    return next((r for r in logged(out) if str(r.get("guard", "")).startswith("split")), None)


def served(out: Path, step: int) -> dict[str, set[str]]:
    """Role -> the adapters (name without the run id) that served its logged turns."""
    out_roles: dict[str, set[str]] = {}
    for line in (out / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines():
        for t in json.loads(line)["turns"]:
            out_roles.setdefault(t["role"], set()).add(t["adapter"]["name"].split("/")[-1])
    return out_roles


@pytest.fixture(scope="module")
def split_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("split")
    out = work / "run"
    with Cluster(work / "cluster", str(demo_model_dir()), engine="transformers",
                 sandbox_replicas=0) as c:
        run_id = submit(c, split_spec(out))
        deadline = time.monotonic() + 1200
        while (row := split_row(out)) is None:
            assert time.monotonic() < deadline, "no split within 20 minutes"
            so_far = logged(out)
            assert not so_far or so_far[-1]["step"] < STEPS, (
                "the run ended without a split: " + str([r.get("alarms") for r in so_far])
            )
            time.sleep(0.2)
        killed_after = logged(out)[-1]["step"]
        kill_learner(c)
        assert killed_after < STEPS, "the split came at the last step: nothing left to resume"
        start_learner(c)
        run = wait_end(c, run_id, timeout_s=1500)
        assert c.redis_url is not None
        acks = redis.Redis.from_url(c.redis_url).hkeys(acks_key(run_id))
        yield {
            "run": run, "out": out, "split": row, "killed_after": killed_after,
            "acks": [a.decode() if isinstance(a, bytes) else a for a in acks],
        }


def test_split_at_the_alarm_trains_on_with_two_adapters(split_run: dict[str, Any]) -> None:
    run, out, row = split_run["run"], split_run["out"], split_run["split"]
    assert run.state == "SUCCEEDED", run.error
    at = row["step"]
    assert row["guard"].startswith("split: sp_role_capture[aggregator]"), row["guard"]
    assert "role aggregator on adapter aggregator, a copy of shared" in row["guard"]
    assert row["routing"] == "aggregator=aggregator,generator=shared"
    records = rows(out)
    assert [r["step"] for r in records] == list(range(STEPS + 1))  # each step once
    splits = [r["step"] for r in records if str(r.get("guard", "")).startswith("split")]
    assert splits == [at]
    for r in records[1:]:
        if r["step"] <= at:
            assert "policy/aggregator/optimizer_steps" not in r
        else:  # both adapters train after the split, the resumed learner's steps included
            assert r["policy/aggregator/optimizer_steps"] >= 1, r["step"]
            assert r["policy/shared/optimizer_steps"] >= 1, r["step"]
    # the run record lists the split with the alarms
    assert any("split: sp_role_capture[aggregator]" in a for a in run.alarms), list(run.alarms)


def test_both_adapters_are_pushed_and_serve_their_roles(split_run: dict[str, Any]) -> None:
    out, at = split_run["out"], split_run["split"]["step"]
    assert served(out, at) == {"generator": {"shared"}, "aggregator": {"shared"}}
    for step in range(at + 1, STEPS + 1):  # the step after the split, and after the resume
        assert served(out, step) == {"generator": {"shared"}, "aggregator": {"aggregator"}}
    pushed = {a.split("/")[-1].split("@")[0] for a in split_run["acks"]}
    assert pushed == {"shared", "aggregator"}


def test_resumed_learner_keeps_the_split_routing(split_run: dict[str, Any]) -> None:
    out, killed_after = split_run["out"], split_run["killed_after"]
    resumed = [
        json.loads(line)["turns"]
        for line in (out / "rollouts" / f"step_{STEPS:06d}.jsonl").read_text().splitlines()
    ]
    # a fresh version range: the turns after the resume came from the second learner
    first_versions = {
        t["adapter"]["version"]
        for line in (out / "rollouts" / f"step_{killed_after:06d}.jsonl").read_text().splitlines()
        for t in json.loads(line)["turns"]
    }
    assert all(t["adapter"]["version"] > max(first_versions) for ts in resumed for t in ts)
    state = json.loads((out / "checkpoints" / "step_000010" / "state.json").read_text())
    assert state["routing"] == {"generator": "shared", "aggregator": "aggregator"}
    assert state["adapters"] == ["aggregator", "shared"]


def test_final_checkpoint_adapters_load_in_peft(split_run: dict[str, Any]) -> None:
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ckpt = split_run["out"] / "checkpoints" / "step_000010" / "adapters"
    assert sorted(p.name for p in ckpt.iterdir()) == ["aggregator", "shared"]
    weights = {}
    for name in ("aggregator", "shared"):
        base = AutoModelForCausalLM.from_pretrained(str(demo_model_dir()))
        model = PeftModel.from_pretrained(base, str(ckpt / name))
        assert any("lora_B" in n for n, _ in model.named_parameters())
        weights[name] = load_file(str(ckpt / name / "adapter_model.safetensors"))
    # two adapters that trained apart since the split
    assert any(
        not torch.equal(v, weights["shared"][k]) for k, v in weights["aggregator"].items()
    )
