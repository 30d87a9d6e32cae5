"""GRPO's math: group-relative advantages, failed-episode filtering and the clipped loss.

One outcome reward per whole-workflow rollout; the advantage is relative to the
other rollouts of the same problem, and every token every role emitted in the
rollout carries it (paper §A.7). A failed episode (no replica, sandbox down) is
no score: it is left out of its group, and a group left with fewer than two
good rollouts carries no comparison and is dropped. Each adapter's loss is
aggregated over its own mini-batch as `grpo.loss_agg` says; no KL term. Off-policy
tokens (`train.max_staleness` >= 1) are reweighted by π_old/μ, truncated (update.py).

Beyond the paper, each off by default (the formulas and sources are in GRPOSpec's
docstrings): a leave-one-out baseline (RLOO), per-role normalisation (Dr. MAS), GSPO's
sequence-level ratio, a KL penalty to the base model (k1, k2, k3), an entropy bonus,
DAPO's soft overlong band and its dynamic sampling's signal test; pass@k for validation.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch


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


def overlong_penalty(length: int, cap: int, band: int, penalty: float) -> float:
    """DAPO's soft overlong punishment of one response of `length` tokens under a cap
    of `cap`: 0 up to cap - band, then falling linearly to -penalty at the cap (and held
    there beyond it)."""
    if band <= 0:
        return 0.0
    over = length - (cap - band)
    return -penalty * min(max(over, 0) / band, 1.0)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one problem from n samples of which c are correct:
    1 - C(n-c, k) / C(n, k) (Chen et al. 2021, eq. 1, in its stable product form)."""
    assert 0 <= c <= n and 1 <= k <= n, (n, c, k)
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


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


def token_weights(completion_lengths: Sequence[int], loss_agg: str) -> list[float]:
    """Weight of each token of each sequence in one mini-batch's loss (they sum to 1).

    token_mean: 1 / (tokens in the mini-batch); seq_mean_token_mean: 1 / (sequences
    x this sequence's tokens). Weights fixed per mini-batch make micro-batches
    accumulate to exactly the mini-batch's loss.
    """
    if loss_agg == "token_mean":
        total = sum(completion_lengths)
        return [1.0 / max(total, 1)] * len(completion_lengths)
    assert loss_agg == "seq_mean_token_mean", loss_agg
    n = len(completion_lengths)
    return [1.0 / (n * max(length, 1)) for length in completion_lengths]


@dataclass
class LossStats:
    loss: float
    tokens: int
    clipped_low: int
    """Tokens whose ratio fell below 1 - clip_low with a negative advantage (no gradient)."""
    clipped_high: int
    """Tokens whose ratio rose above 1 + clip_high with a positive advantage."""
    ratio_min: float
    ratio_max: float

    @property
    def clip_fraction(self) -> float:
        return (self.clipped_low + self.clipped_high) / max(self.tokens, 1)


def sequence_log_ratio(log_ratio: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """GSPO: each token's log-ratio replaced by its sequence's mean log-ratio, so that
    exp() of it is s_i = (π(y_i)/π_old(y_i))^(1/|y_i|) on every token of sequence i; the
    gradient flows through the mean. `log_ratio` is flat, the sequences' tokens in order."""
    parts = [part.mean().expand(len(part)) for part in log_ratio.split(list(lengths))]
    return torch.cat(parts) if parts else log_ratio


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(π || π_ref) at the sampled token, log r = log π_ref - log π:
    k1 = -log r, k2 = (log r)² / 2, k3 = exp(log r) - 1 - log r (Schulman 2020)."""
    log_r = ref_logp - logp
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    assert estimator == "k3", estimator
    return torch.exp(log_r) - 1.0 - log_r


def clipped_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    weights: torch.Tensor | None = None,
    seq_lengths: Sequence[int] | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """PPO-clip surrogate: sum over masked tokens of per-token loss x `weights`.

    All tensors are [batch, length]; `advantages` and `weights` are already spread
    over tokens. `weights` defaults to a token-mean over this batch's mask. With
    `seq_lengths` (flat tensors, GSPO) the ratio is each sequence's s_i, clipped per sequence.
    """
    mask = mask.to(logp.dtype)
    if weights is None:
        weights = torch.full_like(logp, 1.0 / max(float(mask.sum()), 1.0))
    if seq_lengths is None:
        ratio = torch.exp(logp - old_logp)
    else:
        ratio = torch.exp(sequence_log_ratio(logp - old_logp, seq_lengths))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    loss = (per_token * mask * weights).sum()
    with torch.no_grad():
        m = mask.bool()
        low = (ratio < 1.0 - clip_low) & (advantages < 0) & m
        high = (ratio > 1.0 + clip_high) & (advantages > 0) & m
        r = ratio[m]
        stats = LossStats(
            loss=float(loss),
            tokens=int(m.sum()),
            clipped_low=int(low.sum()),
            clipped_high=int(high.sum()),
            ratio_min=float(r.min()) if r.numel() else 1.0,
            ratio_max=float(r.max()) if r.numel() else 1.0,
        )
    return loss, stats


def behaviour_weights(old: torch.Tensor, sample_logprobs: list[float], cap: float) -> torch.Tensor:
    """π_old/μ per token, truncated at `cap`: μ's log-probs are what inference reported."""
    mu = torch.tensor(sample_logprobs[: len(old)], dtype=old.dtype, device=old.device)
    return torch.exp(old - mu).clamp(max=cap)


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    clip_low: float,
    clip_high: float,
    seq_lengths: Sequence[int] | None = None,
    kl: tuple[float, str, torch.Tensor] | None = None,
    entropy: tuple[float, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, LossStats, float]:
    """One micro-batch's part of its mini-batch's loss, over its completion tokens (flat):
    the clipped surrogate (`clipped_loss`), plus `kl` = (coefficient, estimator, the base
    model's log-probs) times the weighted KL estimate, minus `entropy` = (coefficient, the
    tokens' entropies) times the weighted entropy. Returns the loss, the surrogate's stats
    and the KL estimate's value (0 without it)."""
    loss, stats = clipped_loss(
        logp, old_logp, advantages, torch.ones_like(logp), clip_low, clip_high, weights,
        seq_lengths,
    )
    kl_value = 0.0
    if kl is not None:
        coef, estimator, ref_logp = kl
        estimate = (kl_penalty(logp, ref_logp, estimator) * weights).sum()
        loss = loss + coef * estimate
        kl_value = float(estimate.detach())
    if entropy is not None:
        coef, ent = entropy
        loss = loss - coef * (ent * weights).sum()
    return loss, stats, kl_value


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """`x` upcast from a half-precision dtype; float32 and float64 kept as they are, so a
    float64 reference step (the golden test's) stays float64 through the softmax."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log pi(target) under logits / temperature; logits [B, L, V], targets [B, L]."""
    scaled = at_least_float32(logits) / (temperature if temperature > 0 else 1.0)
    return torch.log_softmax(scaled, dim=-1).gather(-1, targets[..., None]).squeeze(-1)


def token_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    scaled = at_least_float32(logits) / (temperature if temperature > 0 else 1.0)
    logp = torch.log_softmax(scaled, dim=-1)
    return -(logp.exp() * logp).sum(-1)
