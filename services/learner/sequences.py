"""Rollouts to training sequences: one per role turn, masked to what the role emitted."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from marl.rollout import Rollout


@dataclass
class Sequence:
    policy: str
    role: str
    tokens: list[int]
    """Prompt ids followed by completion ids."""
    n_prompt: int
    advantage: float
    sample_logprobs: list[float]
    """Per completion token, as inference reported them."""


def build_sequences(
    rollouts: list[Rollout], advantages: list[float], policy_of_role: dict[str, str]
) -> list[Sequence]:
    """Every turn of every rollout becomes a sequence carrying its rollout's advantage."""
    out = []
    for rollout, adv in zip(rollouts, advantages, strict=True):
        for turn in rollout.turns:
            if not turn.completion_ids:
                continue
            out.append(
                Sequence(
                    policy=policy_of_role[turn.role],
                    role=turn.role,
                    tokens=turn.prompt_ids + turn.completion_ids,
                    n_prompt=len(turn.prompt_ids),
                    advantage=adv,
                    sample_logprobs=list(turn.logprobs),
                )
            )
    return out


def turn_owners(rollouts: list[Rollout]) -> list[int]:
    """The rollout of each sequence build_sequences makes, in its order."""
    return [k for k, r in enumerate(rollouts) for t in r.turns if t.completion_ids]


@dataclass
class Batch:
    input_ids: torch.Tensor
    """[B, L] right-padded."""
    attention_mask: torch.Tensor
    targets: torch.Tensor
    """[B, L-1]: input_ids shifted left (the token each position predicts)."""
    loss_mask: torch.Tensor
    """[B, L-1]: 1 where the target is a completion token."""
    advantages: torch.Tensor
    """[B, L-1]: each sequence's advantage on every position."""


def collate(seqs: list[Sequence], pad_id: int) -> Batch:
    width = max(len(s.tokens) for s in seqs)
    n = len(seqs)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    loss_mask = torch.zeros((n, width - 1))
    adv = torch.zeros((n, width - 1))
    for i, s in enumerate(seqs):
        input_ids[i, : len(s.tokens)] = torch.tensor(s.tokens, dtype=torch.long)
        attn[i, : len(s.tokens)] = 1
        # position j predicts token j+1; completion tokens are n_prompt .. len-1
        loss_mask[i, s.n_prompt - 1 : len(s.tokens) - 1] = 1
        adv[i, :] = s.advantage
    return Batch(input_ids, attn, input_ids[:, 1:], loss_mask, adv)
