"""A step's advantages, in the order they are made: rewards → shaped → group-normalised →
per sequence.

One outcome reward per whole-workflow rollout; the advantage is relative to the other
rollouts of the same problem (its group), and every token every role emitted in the
rollout carries it (paper §A.7). A failed episode (no replica, sandbox down) is no score:
it is left out of its group, and a group left with fewer than two good rollouts carries
no comparison and is dropped (`good_rollouts`).

Each option is off by default, and the step is then the paper's to the last bit
(tests/unit/test_objectives.py): DAPO's overlong band shapes the rewards
(`shaped_rewards`); a leave-one-out baseline (RLOO) and the std normalisation are
`group_advantages`'; and a rollout's turns get advantages of their own
(`sequence_advantages`) under per-role normalisation (Dr. MAS's `advantage_norm: role`)
or when roles are rewarded apart (`Rollout.role_rewards`).

Per-role rewards: a role not named in `Rollout.role_rewards` gets the rollout's reward.
Each turn of role r in a rollout of group g carries R = role_rewards[r] plus the
rollout's shaping, and its advantage is group-relative among the turns of the same role
in the same group:

    A = (R - mean_{g,r} R) / (std_{g,r} R + eps)      (grpo.normalize_std; else R - mean)

with `grpo.baseline: leave_one_out` taking the mean of the others instead. So a role
rewarded on its own criterion is compared only with itself across the group's samples:
one role's reward scale cannot swamp another's, and a role whose reward did not vary in
the group gets advantage 0 (Dr. MAS's agent-wise normalisation, Feng et al. 2026,
arXiv:2602.08847, applied to per-role rewards). A role with several turns per rollout
(parallel slots, rounds) has each of them counted among its group's turns.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from marl.rollout import Rollout
from marl.spec.run import GRPOSpec, RunSpec, response_cap
from services.learner.sequences import turn_owners


def good_rollouts(errors: Sequence[bool], groups: Sequence[Hashable]) -> tuple[list[int], int]:
    """Indices of the rollouts that train: not failed, in a group with >= 2 good ones.

    Returns them and the number of groups dropped (every group that had a failed
    rollout and kept fewer than two good ones).
    """
    good: dict[Hashable, list[int]] = defaultdict(list)
    seen: dict[Hashable, None] = {}
    for i, (err, g) in enumerate(zip(errors, groups, strict=True)):
        seen[g] = None
        if not err:
            good[g].append(i)
    kept = sorted(i for idx in good.values() if len(idx) >= 2 for i in idx)
    dropped = sum(1 for g in seen if len(good.get(g, [])) < 2)
    return kept, dropped


def overlong_penalty(length: int, cap: int, band: int, penalty: float) -> float:
    """DAPO's soft overlong punishment of one response of `length` tokens under a cap
    of `cap`: 0 up to cap - band, then falling linearly to -penalty at the cap (and held
    there beyond it)."""
    if band <= 0:
        return 0.0
    over = length - (cap - band)
    return -penalty * min(max(over, 0) / band, 1.0)


def shaped_rewards(rollouts: list[Rollout], spec: RunSpec) -> list[float]:
    """Each rollout's reward as the advantages see it: with `grpo.overlong`, plus DAPO's
    soft overlong penalty of its longest turn."""
    g = spec.grpo
    if g.overlong == 0:
        return [r.reward for r in rollouts]
    cap = response_cap(spec)
    return [
        r.reward
        + overlong_penalty(
            max((len(t.completion_ids) for t in r.turns), default=0),
            cap,
            g.overlong,
            g.overlong_penalty,
        )
        for r in rollouts
    ]


def group_advantages(
    rewards: Sequence[float],
    groups: Sequence[Hashable],
    normalize_std: bool = True,
    eps: float = 1e-6,
    baseline: str = "group",
) -> list[float]:
    """(r - mean of its group) / (std of its group + eps); std is the unbiased estimate.
    `baseline` leave_one_out: r - mean of the group's others, = G/(G-1) (r - mean) (RLOO).

    A group whose rewards are all equal carries no signal: advantage 0.
    """
    assert len(rewards) == len(groups)
    members: dict[Hashable, list[int]] = defaultdict(list)
    for i, g in enumerate(groups):
        members[g].append(i)
    out = [0.0] * len(rewards)
    for idx in members.values():
        r = torch.tensor([float(rewards[i]) for i in idx], dtype=torch.float64)
        centered = r - r.mean()
        assert baseline in ("group", "leave_one_out"), baseline
        if baseline == "leave_one_out" and len(idx) > 1:  # a lone rollout is centred to 0
            centered = centered * (len(idx) / (len(idx) - 1))
        if normalize_std:
            std = float(r.std(unbiased=True)) if len(idx) > 1 else 0.0
            centered = centered / (std + eps) if std > 0 else torch.zeros_like(centered)
        for j, i in enumerate(idx):
            out[i] = float(centered[j])
    return out


def signal_groups(rewards: Sequence[float], groups: Sequence[Hashable]) -> set[Hashable]:
    """The groups whose rewards are not all equal: those that carry a comparison (DAPO's
    dynamic sampling keeps only these)."""
    values: dict[Hashable, set[float]] = defaultdict(set)
    for r, g in zip(rewards, groups, strict=True):
        values[g].add(float(r))
    return {g for g, v in values.items() if len(v) > 1}


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
    rollouts: list[Rollout], rewards: list[float], groups: list[str], g: GRPOSpec
) -> list[float] | None:
    """One advantage per trained turn (build_sequences' order), normalised per (group,
    role), where a rollout's turns do not share one: when any role is rewarded apart
    (`turn_rewards`), or under `grpo.advantage_norm: role` (each turn carrying its
    rollout's shaped reward). None otherwise: every turn takes its rollout's advantage."""
    if any(r.role_rewards for r in rollouts):
        turns = turn_rewards(rollouts, rewards)
    elif g.advantage_norm == "role":
        owners = turn_owners(rollouts)
        roles = [t.role for r in rollouts for t in r.turns if t.completion_ids]
        turns = [(k, role, rewards[k]) for k, role in zip(owners, roles, strict=True)]
    else:
        return None
    return group_advantages(
        [r for _, _, r in turns],
        [(groups[k], role) for k, role, _ in turns],
        g.normalize_std,
        baseline=g.baseline,
    )


@dataclass
class Advantages:
    """A step's rollouts that train and what the step makes of their rewards."""

    rollouts: list[Rollout]
    groups: list[str]
    """Each rollout's problem."""
    rewards: list[float]
    """As shaped (`shaped_rewards`)."""
    per_rollout: list[float]
    per_sequence: list[float] | None
    """A turn's own, where the options give turns their own (`sequence_advantages`)."""
    groups_dropped: int


def step_advantages(rollouts: list[Rollout], groups: list[str], spec: RunSpec) -> Advantages:
    """The step's advantages: failed episodes out, rewards shaped, normalised in each group,
    then per sequence where the options say so."""
    g = spec.grpo
    keep, dropped = good_rollouts([r.error is not None for r in rollouts], groups)
    rollouts = [rollouts[i] for i in keep]
    groups = [groups[i] for i in keep]
    rewards = shaped_rewards(rollouts, spec)
    return Advantages(
        rollouts,
        groups,
        rewards,
        group_advantages(rewards, groups, g.normalize_std, baseline=g.baseline),
        sequence_advantages(rollouts, rewards, groups, g),
        dropped,
    )
