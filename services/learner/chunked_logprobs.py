"""log π(target) and the entropy at N positions straight from their hidden states and the
output head, a block of positions x a block of the vocabulary at a time.

The whole [N x V] float32 logits are the largest tensor of a GRPO update (V is 49,152 for
SmolLM2, 151,936 for Qwen3) and, kept for autograd, most of its memory traffic. Here no
more than one block of them exists at a time, in the forward and in the backward
alike: the forward keeps, per position, a running maximum, Σ exp and Σ exp·z over the
vocabulary blocks (an online log-sum-exp, as Liger's fused linear cross-entropy and
prime-rl's chunked logits do) and saves only the log-sum-exp and the entropy; the
backward recomputes each block's logits and sends d/dz straight into the hidden states'
(and, when it trains, the head's) gradient. The arithmetic is log_softmax(h Wᵀ / T):

    z = (h Wᵀ + b) / T,   lse = log Σ_v exp z_v,   log π(y) = z_y - lse,
    H = lse - Σ_v p_v z_v   (p = exp(z - lse)),
    ∂log π(y)/∂z_v = 1[v = y] - p_v,   ∂H/∂z_v = -p_v (z_v - lse + H).

Logits are computed in the head's dtype (bf16 where the model is) and accumulated in float32
(float64 for a float64 model: the golden reference step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

BLOCK_BYTES = 64 * 2**20
"""float32 logits per block: a block of positions x a block of the vocabulary."""

MIN_BLOCK_POSITIONS = 256
"""Positions a block holds at least, the vocabulary split to keep it within BLOCK_BYTES:
fewer would leave the head's matmul too thin to run at the hardware's pace."""


def block_shape(positions: int, vocab: int, block_bytes: int, itemsize: int = 4) -> tuple[int, int]:
    """(positions, vocabulary columns) of one block of at most `block_bytes` logits: the
    whole vocabulary when MIN_BLOCK_POSITIONS rows of it fit, else split into equal parts."""
    per_row = vocab * itemsize
    rows = block_bytes // per_row
    if rows >= min(positions, MIN_BLOCK_POSITIONS):
        return max(1, min(positions, rows)), vocab
    rows = max(1, min(positions, MIN_BLOCK_POSITIONS))
    parts = -(-rows * per_row // max(block_bytes, 1))
    return rows, -(-vocab // parts)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _block_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  inv_t: float, acc: torch.dtype) -> torch.Tensor:
    z = torch.nn.functional.linear(h, weight, bias).to(acc)
    return z.mul_(inv_t) if inv_t != 1.0 else z


@dataclass(frozen=True)
class _Blocks:
    inv_t: float
    rows: int
    cols: int
    entropy: bool
    entropy_grad: bool


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
        targets: torch.Tensor, blocks: _Blocks,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inv_t, rows, cols, want_entropy = blocks.inv_t, blocks.rows, blocks.cols, blocks.entropy
        acc = _accumulation_dtype(h.dtype)
        n, vocab = h.shape[0], weight.shape[0]
        logp = torch.empty(n, dtype=acc, device=h.device)
        lse = torch.empty(n, dtype=acc, device=h.device)
        entropy = torch.empty(n if want_entropy else 0, dtype=acc, device=h.device)
        for r0 in range(0, n, rows):
            hr, y = h[r0 : r0 + rows], targets[r0 : r0 + rows]
            k = hr.shape[0]
            peak = torch.full((k,), float("-inf"), dtype=acc, device=h.device)
            total = torch.zeros(k, dtype=acc, device=h.device)
            weighted = torch.zeros(k, dtype=acc, device=h.device)
            picked = torch.zeros(k, dtype=acc, device=h.device)
            for c0 in range(0, vocab, cols):
                z = _block_logits(hr, weight[c0 : c0 + cols],
                                  None if bias is None else bias[c0 : c0 + cols], inv_t, acc)
                new_peak = torch.maximum(peak, z.amax(-1))
                rescale = torch.exp(peak - new_peak)
                e = torch.exp(z - new_peak[:, None])
                total = total * rescale + e.sum(-1)
                if want_entropy:
                    weighted = weighted * rescale + (e * z).sum(-1)
                peak = new_peak
                here = (y >= c0) & (y < c0 + z.shape[1])
                local = (y - c0).clamp(0, z.shape[1] - 1)
                picked += torch.where(here, z.gather(-1, local[:, None]).squeeze(-1), 0.0)
            block_lse = peak + torch.log(total)
            lse[r0 : r0 + k] = block_lse
            logp[r0 : r0 + k] = picked - block_lse
            if want_entropy:
                entropy[r0 : r0 + k] = block_lse - weighted / total
        ctx.save_for_backward(h, weight, bias, targets, lse, entropy)
        ctx.blocks = blocks
        if not blocks.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        h, weight, bias, targets, lse, entropy = ctx.saved_tensors
        blocks: _Blocks = ctx.blocks
        inv_t, rows, cols = blocks.inv_t, blocks.rows, blocks.cols
        acc = lse.dtype
        n, vocab = h.shape[0], weight.shape[0]
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        want_b = bias is not None and ctx.needs_input_grad[2]
        g_ent = grad_entropy if blocks.entropy_grad and entropy.numel() > 0 else None
        grad_h = torch.zeros_like(h) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if want_b else None
        g_lp = grad_logp if grad_logp is not None else torch.zeros_like(lse)
        for r0 in range(0, n, rows):
            hr, y = h[r0 : r0 + rows], targets[r0 : r0 + rows]
            k = hr.shape[0]
            g = g_lp[r0 : r0 + k].to(acc)
            block_lse = lse[r0 : r0 + k, None]
            g_h = torch.zeros((k, h.shape[1]), dtype=acc, device=h.device) if want_h else None
            for c0 in range(0, vocab, cols):
                w = weight[c0 : c0 + cols]
                z = _block_logits(hr, w, None if bias is None else bias[c0 : c0 + cols],
                                  inv_t, acc)
                p = torch.exp(z - block_lse)
                dz = p * -g[:, None]
                if g_ent is not None:
                    ge = g_ent[r0 : r0 + k].to(acc)
                    shift = entropy[r0 : r0 + k] - block_lse[:, 0]
                    dz -= ge[:, None] * p * (z + shift[:, None])
                here = (y >= c0) & (y < c0 + z.shape[1])
                rows_here = here.nonzero().squeeze(-1)
                dz[rows_here, y[rows_here] - c0] += g[rows_here]
                if inv_t != 1.0:
                    dz *= inv_t
                if g_h is not None:
                    g_h += dz.to(w.dtype).matmul(w).to(acc)
                if grad_w is not None:
                    grad_w[c0 : c0 + cols] += dz.T.matmul(hr.to(acc))
                if grad_b is not None:
                    grad_b[c0 : c0 + cols] += dz.sum(0)
            if grad_h is not None and g_h is not None:
                grad_h[r0 : r0 + k] = g_h.to(h.dtype)
        return (
            grad_h,
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            None, None,
        )


def head_logprobs(
    h: torch.Tensor,
    head: torch.nn.Linear,
    targets: torch.Tensor,
    temperature: float,
    *,
    entropy: bool = False,
    entropy_grad: bool = False,
    block_bytes: int = BLOCK_BYTES,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(target) at each of N positions, `h` [N, D] their hidden states, `targets`
    [N]; with `entropy`, the entropies too (differentiable when `entropy_grad`). The same
    numbers as log_softmax(head(h) / T) (see the module docstring) in float32 (float64
    for a float64 `h`), a block of at most `block_bytes` logits at a time."""
    inv_t = 1.0 / (temperature if temperature > 0 else 1.0)
    rows, cols = block_shape(max(h.shape[0], 1), head.weight.shape[0], block_bytes,
                             torch.finfo(_accumulation_dtype(h.dtype)).bits // 8)
    blocks = _Blocks(inv_t, rows, cols, entropy, entropy_grad)
    logp, ent = _HeadLogprobs.apply(h, head.weight, head.bias, targets.to(h.device), blocks)
    return logp, (ent if entropy else None)
