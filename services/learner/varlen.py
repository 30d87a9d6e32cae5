"""Variable-length attention: a micro-batch's sequences one after another in one row.

Dense rows (prompt_rows.layout) pad a micro-batch to its widest row, and rows that share
a prompt or pack blocks need a [rows, 1, L, L] mask, which only the masked attention
kernels take. Here every token of the micro-batch sits in a single row with no padding,
and attention runs per segment from cumulative lengths, as FlashAttention's varlen
kernel takes them (torch.nn.attention.varlen, on CUDA in bf16 or fp16): the projections
and MLPs see real tokens only, and each segment attends within itself.

A segment is a run of query tokens and the keys they see:
- a sequence that shares no prompt: its tokens, and they are its keys;
- a prompt that completions share: its tokens, and they are its keys;
- a completion of a shared prompt: its tokens; its keys are the prompt's, then its own.
Causality is counted from the end (the last query sees every key), so token j of a
completion sees the prompt and the completion's tokens up to j: prompt_rows' block mask.
Position ids restart at 0 with each prompt, as there.

The attention function is registered with transformers under `VARLEN`; a forward
without a layout (`varlen_layout` unset) runs transformers' SDPA attention with the
mask transformers builds for it, so the model still works for any other caller.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from services.learner.prompt_rows import Rows, plan_rows
from services.learner.sequences import Sequence

VARLEN = "marl_varlen"
"""The attention implementation's name in transformers' registries."""

VARLEN_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
"""Architectures whose attention is plain causal softmax attention through transformers'
attention interface (no soft-capping, sinks or per-layer masks); a sliding window, where
their config turns one on, rules varlen out (`varlen_supported`)."""


@dataclass
class VarlenLayout:
    """Segments of one row of `width` tokens: segment s's queries are tokens
    cu_q[s]..cu_q[s+1] of the row, its keys the tokens `keys[cu_k[s]:cu_k[s+1]]`."""

    width: int
    cu_q: list[int]
    cu_k: list[int]
    keys: list[int]
    _tensors: dict[tuple[int, str], tuple[torch.Tensor, ...]] = field(
        default_factory=dict, repr=False
    )

    @property
    def max_q(self) -> int:
        return max((b - a for a, b in itertools.pairwise(self.cu_q)), default=0)

    @property
    def max_k(self) -> int:
        return max((b - a for a, b in itertools.pairwise(self.cu_k)), default=0)

    def tensors(self, rows: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(cu_q, cu_k as int32, keys as int64) for `rows` copies of the row flattened one
        after another (a forward of the row twice over, policy.row_features_with_base),
        on `device`; made once per (rows, device)."""
        key = (rows, str(device))
        if key not in self._tensors:
            w, nk = self.width, len(self.keys)
            cu_q = [*(c + r * w for r in range(rows) for c in self.cu_q[:-1]), rows * w]
            cu_k = [*(c + r * nk for r in range(rows) for c in self.cu_k[:-1]), rows * nk]
            keys = [k + r * w for r in range(rows) for k in self.keys]
            self._tensors[key] = (
                torch.tensor(cu_q, dtype=torch.int32, device=device),
                torch.tensor(cu_k, dtype=torch.int32, device=device),
                torch.tensor(keys, dtype=torch.long, device=device),
            )
        return self._tensors[key]


def varlen_rows(seqs: list[Sequence], row_tokens: int) -> Rows:
    """`seqs` as one row (see the module docstring): sequences with equal prompts share it
    as prompt_rows.plan_rows groups them (`row_tokens` positions at most a group; 0: no
    sharing), groups one after another."""
    ids: list[int] = []
    positions: list[int] = []
    cu_q, cu_k, keys = [0], [0], []
    where: list[list[int]] = [[] for _ in seqs]

    def segment(query_end: int, key_tokens: list[int]) -> None:
        cu_q.append(query_end)
        keys.extend(key_tokens)
        cu_k.append(len(keys))

    for block in plan_rows(seqs, row_tokens):
        p = seqs[block[0]].n_prompt
        start = len(ids)
        ids += seqs[block[0]].tokens[:p]
        positions += range(p)
        prompt = list(range(start, start + p))
        if len(block) > 1:
            segment(len(ids), prompt)
        for i in block:
            completion = seqs[i].tokens[p:]
            n, at = len(completion), len(ids)
            # its first token is predicted at the prompt's last position, token j at its j-1
            where[i] = [start + p - 1, *range(at, at + n - 1)]
            ids += completion
            positions += range(p, p + n)
            if n or len(block) == 1:
                segment(len(ids), prompt + list(range(at, at + n)))
    cols = torch.tensor([c for cs in where for c in cs], dtype=torch.long)
    rows = Rows(
        input_ids=torch.tensor([ids], dtype=torch.long),
        attention_mask=None,
        position_ids=torch.tensor([positions], dtype=torch.long),
        rows=torch.zeros_like(cols),
        cols=cols,
        targets=torch.tensor([t for s in seqs for t in s.tokens[s.n_prompt :]], dtype=torch.long),
        lengths=[len(s.tokens) - s.n_prompt for s in seqs],
    )
    rows.varlen = VarlenLayout(len(ids), cu_q, cu_k, keys)
    return rows


Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, VarlenLayout, int, float], torch.Tensor]
"""(queries [T, Hq, D], keys and values gathered per segment [Tk, Hkv, D], layout, rows,
scale) -> [T, Hq, D]."""


def flash_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: VarlenLayout, rows: int,
    scale: float,
) -> torch.Tensor:
    """torch's varlen_attn: FlashAttention's kernel (CUDA, bf16/fp16), causal from the end."""
    from torch.nn.attention.varlen import varlen_attn

    cu_q, cu_k, _ = layout.tensors(rows, q.device)
    out = varlen_attn(
        q, k, v, cu_q, cu_k, max_q=layout.max_q, max_k=layout.max_k, scale=scale,
        window_size=(-1, 0), enable_gqa=q.shape[1] != k.shape[1],
    )
    return out  # type: ignore[return-value]


def segment_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: VarlenLayout, rows: int,
    scale: float,
) -> torch.Tensor:
    """The same attention as `flash_kernel`, one SDPA call per segment: any device and
    dtype."""
    out = []
    nq, nk = layout.width, len(layout.keys)
    for r in range(rows):
        for (q0, q1), (k0, k1) in zip(
            itertools.pairwise(layout.cu_q), itertools.pairwise(layout.cu_k), strict=True
        ):
            lq, lk = q1 - q0, k1 - k0
            qs = q[r * nq + q0 : r * nq + q1].transpose(0, 1)
            ks = k[r * nk + k0 : r * nk + k1].transpose(0, 1)
            vs = v[r * nk + k0 : r * nk + k1].transpose(0, 1)
            mask = None
            if lq != lk:
                mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
            o = torch.nn.functional.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=mask, is_causal=lq == lk, scale=scale,
                enable_gqa=qs.shape[0] != ks.shape[0],
            )
            out.append(o.transpose(0, 1))
    return torch.cat(out)


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    varlen_layout: VarlenLayout | None = None,
    varlen_kernel: Kernel = flash_kernel,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: query [B, Hq, L, D], key and value
    [B, Hkv, L, D] -> [B, L, Hq, D]. With a layout, each of the B rows is laid out by
    it; without, SDPA attention with the mask given."""
    if varlen_layout is None:
        return sdpa_attention_forward(  # type: ignore[no-any-return]
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            **kwargs,
        )
    b, hq, t, d = query.shape
    hkv = key.shape[1]
    _, _, keys = varlen_layout.tensors(b, query.device)
    q = query.transpose(1, 2).reshape(b * t, hq, d)
    k = key.transpose(1, 2).reshape(b * t, hkv, d).index_select(0, keys)
    v = value.transpose(1, 2).reshape(b * t, hkv, d).index_select(0, keys)
    scale = scaling if scaling is not None else d**-0.5
    out = varlen_kernel(q, k, v, varlen_layout, b, scale)
    return out.view(b, t, hq, d), None


def varlen_mask(**kwargs: Any) -> Any:
    """transformers' mask interface: no mask where no padding mask is given (a varlen
    row, or a row with no padding, which causal SDPA covers); else SDPA's."""
    if kwargs.get("attention_mask") is None:
        return None
    return sdpa_mask(**kwargs)


AttentionInterface.register(VARLEN, varlen_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(VARLEN, varlen_mask)


def varlen_supported(model: Any, device: torch.device) -> bool:
    """Whether `model` (a transformers causal LM) runs varlen rows on `device`:
    FlashAttention's varlen kernel on CUDA in bf16 or fp16, an architecture of
    VARLEN_MODEL_TYPES with SDPA attention and no sliding window."""
    config = model.config
    if device.type != "cuda" or model.dtype not in (torch.bfloat16, torch.float16):
        return False
    if config.model_type not in VARLEN_MODEL_TYPES or config._attn_implementation != "sdpa":
        return False
    layer_types = getattr(config, "layer_types", None) or []
    windowed = getattr(config, "use_sliding_window", False) or any(
        t != "full_attention" for t in layer_types
    )
    return not windowed
