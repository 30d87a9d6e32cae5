"""The cliff guard: which alarm calls for what, and a rollback that loads the best
checkpoint's adapters and optimizer state and lowers every learning rate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from marl.diagnostics.alarms import Alarm
from marl.spec.run import RunSpec, parse_spec
from services.learner.checkpoint import Checkpointer
from services.learner.guard import Guard, acts
from tests.support.batches import new_policy, spec, step, voting_batch

CLIFF = Alarm("accuracy_cliff", "all", 5, "validation accuracy 0.3, down 0.2")
ENTROPY = Alarm("entropy_collapse", "generator", 5, "token entropy 1.0 -> 0.2")


def guarded(**guard: object) -> RunSpec:
    base = spec().model_dump(mode="json")
    base["optim"]["policy_lr"] = {"generator": 0.2}
    base["guard"] = guard
    return parse_spec(base)


def test_a_guard_that_only_warns_does_not_act() -> None:
    """A synchronous step's signals wait until after its push only when nothing acts on
    them (schedules.Synchronous.drift_later)."""
    assert not acts(guarded())
    assert not acts(guarded(on_alarm={"entropy_collapse": "warn"}))
    assert acts(guarded(on_alarm={"entropy_collapse": "warn", "accuracy_cliff": "rollback"}))
    assert acts(guarded(on_alarm={"sp_role_capture": "split"}))


def test_decide_stop_wins_and_the_limit_turns_rollback_into_stop() -> None:
    s = guarded(on_alarm={"accuracy_cliff": "rollback", "entropy_collapse": "stop"},
                max_rollbacks=1)
    g = Guard(s)
    assert g.decide([]) is None
    assert g.decide([Alarm("sp_role_capture", "aggregator", 5, "x")]) is None  # warn
    both = g.decide([CLIFF, ENTROPY])
    assert both is not None and (both.kind, both.alarm) == ("stop", ENTROPY)
    back = g.decide([CLIFF])
    assert back is not None and (back.kind, back.why) == (
        "rollback", "guard.on_alarm.accuracy_cliff=rollback"
    )
    g.rollbacks = 1
    limit = g.decide([CLIFF])
    assert limit is not None and limit.kind == "stop"
    assert limit.why == "guard.on_alarm.accuracy_cliff=rollback after guard.max_rollbacks=1 rollbacks"


def test_rollback_restores_the_best_checkpoint_and_halves_learning_rates(
    model_dir: Path, tmp_path: Path
) -> None:
    s = guarded(on_alarm={"accuracy_cliff": "rollback"})
    policy = new_policy(model_dir, "isolated", s)
    checkpointer = Checkpointer(tmp_path, interval=1, total_steps=10, keep=3)
    g = Guard(s)
    assert g.roll_back(policy, checkpointer) is None  # nothing saved yet: nothing to load

    step(policy, voting_batch(0), "isolated", s)
    policy.end_step()
    checkpointer.save(1, policy, {"data_position": 4}, val_accuracy=0.5)
    best = {p: policy.state_dict(p) for p in policy.policies}
    step(policy, voting_batch(1), "isolated", s)
    policy.end_step()
    checkpointer.save(2, policy, {"data_position": 8}, val_accuracy=0.25)  # worse: not best
    assert any(
        not torch.equal(policy.state_dict("generator")[k], v) for k, v in best["generator"].items()
    )

    said = g.roll_back(policy, checkpointer)
    assert said == (
        "adapters back to step 1 (validation accuracy 0.500), learning rate x0.5 (rollback 1 of 2)"
    )
    for p in policy.policies:
        assert all(torch.equal(policy.state_dict(p)[k], v) for k, v in best[p].items())
    rates = {p: policy.optimizers[p].param_groups[0]["lr"] for p in policy.policies}
    assert rates == {"generator": 0.1, "aggregator": 0.25}  # 0.2 and 0.5, halved
    policy.end_step()  # the schedule keeps the lowered rate
    assert policy.schedulers["aggregator"].get_last_lr() == [0.25]

    assert g.roll_back(policy, checkpointer) is not None
    assert policy.optimizers["generator"].param_groups[0]["lr"] == pytest.approx(0.05)
    assert g.rollbacks == 2
