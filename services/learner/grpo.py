"""GRPO's loss: the clipped surrogate over a micro-batch's tokens, its weights, and pass@k.

`grpo_loss` takes one typed input (`LossInputs`: the tokens' log-probs, π_old's, their
advantages and weights) and keyword-only options, and returns `LossOutputs`; the
advantages come from advantages.py. Each adapter's loss is aggregated over its own
mini-batch as `grpo.loss_agg` says; no KL term. Off-policy tokens
(`train.max_staleness` >= 1) are reweighted by π_old/μ, truncated (update.py).

Beyond the paper, each off by default (the formulas and sources are in GRPOSpec's
docstrings): GSPO's sequence-level ratio, a KL penalty to the base model (k1, k2, k3)
and an entropy bonus; pass@k for validation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


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
    *,
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


@dataclass
class LossInputs:
    """One micro-batch's completion tokens, flat, in sequence order."""

    logp: torch.Tensor
    """log π of each token, with its graph."""
    old_logp: torch.Tensor
    """π_old's, the trust region's centre."""
    advantages: torch.Tensor
    weights: torch.Tensor
    """Each token's weight in its mini-batch's loss (0 on a rank's padding micro-batch)."""
    seq_lengths: Sequence[int] | None = None
    """Each sequence's token count, for GSPO's sequence-level ratio; None: per token."""
    ref_logp: torch.Tensor | None = None
    """The base model's log-probs, for the KL term."""
    entropy: torch.Tensor | None = None
    """The tokens' entropies, for the entropy bonus."""


@dataclass
class LossOutputs:
    loss: torch.Tensor
    stats: LossStats
    """The clipped surrogate's."""
    kl: float
    """The weighted KL estimate to the base model (0 without the KL term)."""


def grpo_loss(
    inputs: LossInputs,
    *,
    clip_low: float,
    clip_high: float,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
) -> LossOutputs:
    """One micro-batch's part of its mini-batch's loss: the clipped surrogate
    (`clipped_loss`), plus `kl_coef` times the weighted KL estimate to the base model
    (with `ref_logp`), minus `entropy_coef` times the weighted entropy (with `entropy`)."""
    x = inputs
    loss, stats = clipped_loss(
        x.logp, x.old_logp, x.advantages, torch.ones_like(x.logp), clip_low=clip_low,
        clip_high=clip_high, weights=x.weights, seq_lengths=x.seq_lengths,
    )
    kl_value = 0.0
    if kl_coef > 0 and x.ref_logp is not None:
        estimate = (kl_penalty(x.logp, x.ref_logp, kl_estimator) * x.weights).sum()
        loss = loss + kl_coef * estimate
        kl_value = float(estimate.detach())
    if entropy_coef > 0 and x.entropy is not None:
        loss = loss - entropy_coef * (x.entropy * x.weights).sum()
    return LossOutputs(loss, stats, kl_value)


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
