"""Replaying a logged step's rollouts through the learner's GRPO update, for tests that
check what the learner trained on from outside the learner process."""

from __future__ import annotations

from pathlib import Path

from marl.rollout import Rollout
from marl.spec.run import parse_spec
from marl.workflows import policy_of_role
from services.learner.policy import MultiAdapterPolicy
from services.learner.update import grpo_step


def replay_shared_loss(model_dir: Path, raw: dict, rollouts: list[Rollout]) -> float:
    """The shared adapter's loss of one `grpo_step` on a fresh policy built as the learner
    builds it for the spec `raw` (same seed, version 0)."""
    spec = parse_spec(raw)
    roles = policy_of_role(spec)
    policy = MultiAdapterPolicy(
        str(model_dir),
        sorted(set(roles.values())),
        spec.lora,
        spec.optim,
        spec.train.steps,
        spec.model.dtype,
        spec.seed,
    )
    result = grpo_step(policy, rollouts, [r.problem_id for r in rollouts], roles, spec)
    return float(result.metrics["policy/shared/loss"])
