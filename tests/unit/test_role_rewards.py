"""Per-role rewards: each role's advantages normalised over its own rewards, by hand."""

from __future__ import annotations

import pytest

from marl.rollout import AdapterRef, Rollout, Turn
from marl.spec.run import GRPOSpec
from services.learner.advantages import sequence_advantages, turn_rewards
from services.learner.sequences import build_sequences


def turn(role: str) -> Turn:
    return Turn(role, 0, [1, 2], [3], [-0.5], "stop", AdapterRef("r/shared", 0), "x")


def rollout(i: int, problem: str, reward: float, roles: dict[str, float],
            turns: tuple[str, ...] = ("a", "b")) -> Rollout:
    return Rollout(f"t{i}", "r", 1, "train", problem, i, [turn(t) for t in turns], "x",
                   reward, role_rewards=roles)


def test_each_role_is_normalised_over_its_own_rewards() -> None:
    rs = [rollout(0, "p", 1.0, {"a": 1.0, "b": 0.0}), rollout(1, "p", 0.0, {"a": 0.0, "b": 2.0})]
    adv = sequence_advantages(rs, [r.reward for r in rs], ["p", "p"], GRPOSpec())
    # (a): [1, 0], mean 0.5, std 0.7071; (b): [0, 2], mean 1, std 1.4142
    assert adv == pytest.approx([0.70711, -0.70711, -0.70711, 0.70711], abs=1e-4)
    # in build_sequences' order: r0's a, r0's b, r1's a, r1's b
    seqs = build_sequences(rs, [0.0, 0.0], {"a": "shared", "b": "shared"})
    assert [s.role for s in seqs] == ["a", "b", "a", "b"]


def test_unnamed_roles_take_the_rollout_reward_and_its_shaping() -> None:
    rs = [rollout(0, "p", 1.0, {"a": 3.0}), rollout(1, "p", 0.0, {}),
          rollout(2, "q", 1.0, {"a": 1.0}), rollout(3, "q", 1.0, {"a": 1.0})]
    shaped = [0.5, 0.0, 1.0, 1.0]  # rollout 0 lost 0.5 to the overlong band
    turns = turn_rewards(rs, shaped)
    assert [t[2] for t in turns] == [2.5, 0.5, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    adv = sequence_advantages(rs, shaped, ["p", "p", "q", "q"],
                              GRPOSpec(normalize_std=False))
    assert adv == pytest.approx([1.25, 0.25, -1.25, -0.25, 0.0, 0.0, 0.0, 0.0])


def test_absent_role_rewards_change_nothing() -> None:
    """Without role rewards (and at `advantage_norm: workflow`) every turn takes its
    rollout's advantage; one rollout with them gives every turn its own."""
    assert sequence_advantages([rollout(0, "p", 1.0, {})], [1.0], ["p"], GRPOSpec()) is None
    some = [rollout(0, "p", 1.0, {}), rollout(1, "p", 1.0, {"a": 1})]
    assert sequence_advantages(some, [1.0, 1.0], ["p", "p"], GRPOSpec()) is not None
