"""Continuous batching for the transformers engine: rows join and leave a running batch.

A `RunningBatch` holds the rows being decoded together: their left-padded attention
mask, KV cache, next input token and position, each row with its own adapter,
sampling settings, seeded generator and token budget. Requests that arrive while it
runs are prefilled as a group and merged in before the next decode step (the shorter
of the two caches is left-padded, masked out), so they do not wait for the batch to
end; a row that stops leaves at once, its result delivered, and the columns no row
attends any more are cut off. Each row's tokens depend only on its own prompt,
adapter and seed: its sampling draws come from its own generator, whatever else
shares the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from services.inference.engine import GenerationRequest, GenerationResult


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    generators: list[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row sampling; returns (token ids, their log-probs under the sampling distribution)."""
    logits = logits.float()
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    if bool((top_p < 1).any()):
        sorted_lp, idx = torch.sort(logp, dim=-1, descending=True)
        cum = sorted_lp.exp().cumsum(-1)
        drop_sorted = (cum - sorted_lp.exp()) >= top_p[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        logp = torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)
    uniform = torch.empty_like(logp)
    for i, gen in enumerate(generators):
        uniform[i] = torch.rand(logp.shape[-1], generator=gen)
    gumbel = -torch.log(-torch.log(uniform.clamp_min(1e-20)))
    sampled = torch.argmax(logp + gumbel, dim=-1)
    tokens = torch.where(greedy, torch.argmax(logp, dim=-1), sampled)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


@dataclass
class Row:
    request: GenerationRequest
    adapter: str
    """The model's name for the row's adapter (PEFT's `adapter_names` entry)."""
    owner: Any
    """What the caller gets the result back with (the engine's pending request)."""
    stops: set[int]
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None

    def take(self, token: int, logprob: float) -> bool:
        """Record a sampled token; whether the row is finished."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if token in self.stops:
            self.finish = "stop"
        elif len(self.tokens) >= self.request.max_tokens:
            self.finish = "length"
        return self.finish is not None

    def result(self) -> GenerationResult:
        return GenerationResult(self.tokens, self.logprobs, self.finish or "length")


def _joinable(cache: Any) -> bool:
    """Whether rows can be merged into and cut out of `cache` by editing its tensors:
    every layer a plain full-attention DynamicLayer (not a sliding window)."""
    layers: list[Any] = getattr(cache, "layers", None) or []
    return bool(layers) and all(type(layer).__name__ == "DynamicLayer" for layer in layers)


class RunningBatch:
    def __init__(self, pad_token_id: int, eos_token_ids: list[int]):
        self.pad_token_id = pad_token_id
        self.eos_token_ids = eos_token_ids
        self.rows: list[Row] = []
        self.mask: torch.Tensor | None = None
        """[B, L]: 1 where a row's cached position is real; L is the cache's length."""
        self.past: Any = None
        self.last: torch.Tensor | None = None
        """[B]: each row's newest token, the next step's input."""
        self.pos: torch.Tensor | None = None
        """[B]: that token's position."""

    def joinable(self) -> bool:
        return self.past is None or _joinable(self.past)

    def new_row(self, request: GenerationRequest, adapter: str, owner: Any) -> Row:
        gen = None if request.seed is None else torch.Generator().manual_seed(request.seed)
        stops = set(self.eos_token_ids) | set(request.stop_token_ids)
        return Row(request, adapter, owner, stops, gen)

    def _forward(
        self,
        model: Callable[..., Any],
        rows: list[Row],
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        past: Any,
        routed: bool,
    ) -> tuple[Any, list[bool]]:
        routing = {"adapter_names": [r.adapter for r in rows]} if routed else {}
        out = model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=past,
            use_cache=True,
            **routing,
        )
        temperature = torch.tensor([r.request.temperature for r in rows])
        top_p = torch.tensor([r.request.top_p if 0 < r.request.top_p < 1 else 1.0 for r in rows])
        tokens, logps = sample(
            out.logits[:, -1, :], temperature, top_p, [r.generator for r in rows]
        )
        done = [r.take(int(t), float(lp)) for r, t, lp in zip(rows, tokens, logps, strict=True)]
        return out.past_key_values, done

    def admit(self, model: Callable[..., Any], rows: list[Row], routed: bool) -> list[Row]:
        """Prefill `rows` as one group and merge the unfinished ones in; the finished
        (a stop token or a budget of one) are returned."""
        n = len(rows)
        width = max(len(r.request.prompt_token_ids) for r in rows)
        input_ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids = r.request.prompt_token_ids
            input_ids[i, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            mask[i, width - len(ids) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        past, done = self._forward(model, rows, input_ids, mask, positions, None, routed)
        keep = [i for i, d in enumerate(done) if not d]
        if keep:
            if len(keep) < n:
                past.batch_select_indices(torch.tensor(keep))
            last = torch.tensor([rows[i].tokens[-1] for i in keep])
            self._merge([rows[i] for i in keep], past, mask[keep], last, positions[keep, -1] + 1)
        return [r for r, d in zip(rows, done, strict=True) if d]

    def _merge(
        self,
        rows: list[Row],
        past: Any,
        mask: torch.Tensor,
        last: torch.Tensor,
        pos: torch.Tensor,
    ) -> None:
        if self.past is None or self.mask is None or self.last is None or self.pos is None:
            self.rows, self.past, self.mask, self.last, self.pos = rows, past, mask, last, pos
            return
        width = max(self.mask.shape[1], mask.shape[1])
        grow = width - self.mask.shape[1]
        grow_new = width - mask.shape[1]
        for mine, theirs in zip(self.past.layers, past.layers, strict=True):
            for attr in ("keys", "values"):
                a = F.pad(getattr(mine, attr), (0, 0, grow, 0))
                b = F.pad(getattr(theirs, attr), (0, 0, grow_new, 0))
                setattr(mine, attr, torch.cat([a, b]))
        self.mask = torch.cat([F.pad(self.mask, (grow, 0)), F.pad(mask, (grow_new, 0))])
        self.last = torch.cat([self.last, last])
        self.pos = torch.cat([self.pos, pos])
        self.rows = self.rows + rows

    def step(self, model: Callable[..., Any], routed: bool) -> list[Row]:
        """One decode step for every row; the rows it finished leave the batch."""
        assert self.mask is not None and self.last is not None and self.pos is not None
        mask = torch.cat([self.mask, torch.ones((len(self.rows), 1), dtype=torch.long)], -1)
        past, done = self._forward(
            model, self.rows, self.last[:, None], mask, self.pos[:, None], self.past, routed
        )
        self.past, self.mask = past, mask
        self.last = torch.tensor([r.tokens[-1] for r in self.rows])
        self.pos = self.pos + 1
        finished = [r for r, d in zip(self.rows, done, strict=True) if d]
        if finished:
            self._drop([i for i, d in enumerate(done) if not d])
        return finished

    def _drop(self, keep: list[int]) -> None:
        """Keep only rows `keep`, and cut the columns none of them attends."""
        assert self.mask is not None and self.last is not None and self.pos is not None
        if not keep:
            self.rows, self.past, self.mask, self.last, self.pos = [], None, None, None, None
            return
        index = torch.tensor(keep)
        self.past.batch_select_indices(index)
        self.rows = [self.rows[i] for i in keep]
        self.mask, self.last, self.pos = self.mask[index], self.last[index], self.pos[index]
        if not _joinable(self.past):
            return
        first = int((self.mask.sum(0) > 0).nonzero()[0])
        if first > 0:
            self.mask = self.mask[:, first:]
            for layer in self.past.layers:
                layer.keys = layer.keys[:, :, first:]
                layer.values = layer.values[:, :, first:]

    def fail_all(self) -> list[Row]:
        rows, self.rows = self.rows, []
        self.past = self.mask = self.last = self.pos = None
        return rows
