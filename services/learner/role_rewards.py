"""Per-role rewards: each role's advantages normalised over that role's own rewards.

A workflow or a reward function may give roles rewards of their own
(`Rollout.role_rewards`, role -> reward; a role not named gets the rollout's reward).
A rollout's turns then do not share one advantage. Each turn of role r in a rollout of
group g (one problem's rollouts) carries R = role_rewards[r] (plus the rollout's reward
shaping, e.g. DAPO's overlong penalty), and its advantage is group-relative among the
turns of the same role in the same group:

    A = (R - mean_{g,r} R) / (std_{g,r} R + eps)      (grpo.normalize_std; else R - mean)

with `grpo.baseline: leave_one_out` taking the mean of the others instead. So a role
rewarded on its own criterion is compared only with itself across the group's samples:
one role's reward scale cannot swamp another's, and a role whose reward did not vary in
the group gets advantage 0. This is Dr. MAS's agent-wise normalisation (Feng et al. 2026,
arXiv:2602.08847) applied to per-role rewards; without role rewards nothing changes.
A role with several turns per rollout (parallel slots, rounds) has each of them counted
among its group's turns.
"""

from __future__ import annotations

from marl.rollout import Rollout
from services.learner.grpo import group_advantages


def present(rollouts: list[Rollout]) -> bool:
    """Whether any rollout carries role rewards."""
    return any(r.role_rewards for r in rollouts)


def turn_rewards(rollouts: list[Rollout], rewards: list[float]) -> list[tuple[int, str, float]]:
    """(rollout index, role, reward) of every trained turn, in build_sequences' order:
    the role's own reward where given, else the rollout's; plus the rollout's shaping
    (`rewards` are the shaped rollout rewards)."""
    out = []
    for k, (rollout, shaped) in enumerate(zip(rollouts, rewards, strict=True)):
        shaping = shaped - rollout.reward
        for turn in rollout.turns:
            if turn.completion_ids:
                own = rollout.role_rewards.get(turn.role, rollout.reward)
                out.append((k, turn.role, own + shaping))
    return out


def sequence_advantages(
    rollouts: list[Rollout],
    rewards: list[float],
    groups: list[str],
    normalize_std: bool = True,
    baseline: str = "group",
) -> list[float]:
    """One advantage per trained turn (build_sequences' order), normalised per (group, role)."""
    turns = turn_rewards(rollouts, rewards)
    return group_advantages(
        [r for _, _, r in turns],
        [(groups[k], role) for k, role, _ in turns],
        normalize_std,
        baseline=baseline,
    )
