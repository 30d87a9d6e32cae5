"""GRPO math against numbers computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from marl.rollout import AdapterRef, Rollout, Turn
from services.learner.advantages import group_advantages
from services.learner.grpo import clipped_loss, token_logprobs, token_weights
from services.learner.sequences import build_sequences, collate


def test_group_advantages_by_hand() -> None:
    # group a: rewards 1, 0, 0, 1 -> mean 0.5, unbiased std sqrt(1/3)
    # group b: all equal -> no signal
    adv = group_advantages([1, 0, 0, 1, 0.5, 0.5], ["a", "a", "a", "a", "b", "b"], eps=0.0)
    s = math.sqrt(1 / 3)
    assert adv[:4] == pytest.approx([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s])
    assert adv[4:] == [0.0, 0.0]


def test_group_advantages_without_std() -> None:
    adv = group_advantages([1.0, 0.0, -0.1], ["g", "g", "g"], normalize_std=False)
    assert adv == pytest.approx([1.0 - 0.3, -0.3, -0.4])


def test_masks_cover_exactly_each_roles_completion() -> None:
    ref = AdapterRef("r/p", 0)
    rollout = Rollout(
        "t",
        "r",
        0,
        "train",
        "p",
        0,
        turns=[
            Turn("generator", 0, [1, 2, 3], [4, 5], [-0.1, -0.2], "stop", ref, ""),
            Turn("aggregator", 0, [6, 7], [8], [-0.3], "stop", ref, ""),
        ],
        final_text="",
        reward=1.0,
    )
    seqs = build_sequences([rollout], [0.75], {"generator": "gen", "aggregator": "agg"})
    assert [(s.policy, s.role, s.tokens, s.n_prompt) for s in seqs] == [
        ("gen", "generator", [1, 2, 3, 4, 5], 3),
        ("agg", "aggregator", [6, 7, 8], 2),
    ]
    b = collate(seqs, pad_id=0)
    assert b.input_ids.tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]]
    assert b.targets.tolist() == [[2, 3, 4, 5], [7, 8, 0, 0]]
    # position j predicts targets[j]; only completion targets (4, 5 / 8) count
    assert b.loss_mask.tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]
    assert (b.advantages == 0.75).all()


def test_clipped_loss_by_hand() -> None:
    # four tokens, one masked out; ratios e^0.5, e^-0.5, 1, (masked)
    logp = torch.tensor([[0.5, -0.5, 0.0, 3.0]])
    old = torch.zeros_like(logp)
    adv = torch.tensor([[1.0, 1.0, -2.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, stats = clipped_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    r1, r2 = math.exp(0.5), math.exp(-0.5)
    # token 1: A>0, ratio 1.6487 > 1.28 -> clipped term -1.28 is the max of (-1.6487, -1.28)
    # token 2: A>0, ratio 0.6065 < 0.8 -> max(-0.6065, -0.8) = -0.6065 (unclipped)
    # token 3: A=-2, ratio 1 -> 2.0
    expected = (max(-r1, -1.28) + max(-r2, -0.8) + 2.0) / 3
    assert float(loss) == pytest.approx(expected)
    assert stats.clip_fraction == pytest.approx(1 / 3)
    assert (stats.clipped_high, stats.clipped_low) == (1, 0)
    assert stats.tokens == 3


def test_clipped_loss_clips_below_with_a_negative_advantage() -> None:
    # ratio e^-0.5 = 0.6065 < 0.8 with A = -1: max(0.6065, 0.8) = 0.8, clipped (no gradient)
    logp = torch.tensor([[-0.5, 0.1]], requires_grad=True)
    loss, stats = clipped_loss(
        logp, torch.zeros((1, 2)), torch.tensor([[-1.0, -1.0]]), torch.ones((1, 2)), clip_low=0.2,
        clip_high=0.28,
    )
    assert float(loss.detach()) == pytest.approx((0.8 + math.exp(0.1)) / 2)
    assert (stats.clipped_low, stats.clipped_high) == (1, 0)
    loss.backward()
    assert logp.grad is not None
    assert logp.grad[0].tolist() == pytest.approx([0.0, math.exp(0.1) / 2])


def test_token_weights_by_hand() -> None:
    assert token_weights([2, 6], "token_mean") == pytest.approx([1 / 8, 1 / 8])
    assert token_weights([2, 6], "seq_mean_token_mean") == pytest.approx([1 / 4, 1 / 12])


def test_clipped_loss_gradient_follows_the_given_weights() -> None:
    logp = torch.zeros((1, 2), requires_grad=True)
    loss, _ = clipped_loss(
        logp,
        torch.zeros((1, 2)),
        torch.tensor([[2.0, 2.0]]),
        torch.ones((1, 2)),
        clip_low=0.2,
        clip_high=0.28,
        weights=torch.full((1, 2), 0.25),
    )
    loss.backward()
    # d/dlogp of -A * exp(logp - old) at ratio 1 = -A, times the weight 1/4
    assert logp.grad is not None
    assert logp.grad.tolist() == [[-0.5, -0.5]]


def test_token_logprobs_uses_temperature() -> None:
    logits = torch.tensor([[[2.0, 0.0]]])
    lp = token_logprobs(logits, torch.tensor([[0]]), temperature=0.5)
    assert float(lp) == pytest.approx(4.0 - math.log(math.exp(4.0) + 1.0), abs=1e-6)
