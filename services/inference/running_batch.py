"""A decode batch that requests join and leave between steps (continuous batching).

Rows are left-padded and share one KV cache. A request that arrives while the batch
decodes is prefilled on its own (one forward over the newcomers' prompts) and its
cache is merged into the running one: both are left-padded to the longer length and
concatenated along the batch, so it decodes from the next step on instead of waiting
for the batch to end. A row leaves as soon as it finishes, so its result goes back at
once and the rows still decoding stop paying for it; padding columns that no row uses
any more are trimmed. Rows stay ordered by adapter, so each adapter's LoRA delta is one
contiguous slice of the batch (multi_lora.py).

Merging needs every cache layer to be a plain `DynamicLayer` (full attention, grown by
concatenation). A model whose cache holds other layers (sliding windows, linear
attention) keeps its batch closed: newcomers wait until the running rows finish.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from services.inference.engine import GenerationRequest, GenerationResult
from services.inference.multi_lora import MultiLoRA
from services.inference.sampling import row_uniforms, sample


@dataclass
class Row:
    """One request being decoded; `tag` is the caller's handle for it."""

    request: GenerationRequest
    adapter: str | None
    """None: the bare base model."""
    stops: frozenset[int]
    tag: Any = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None

    def record(self, token: int, logprob: float) -> bool:
        """Append a sampled token; True once the row is finished."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if token in self.stops:
            self.finish = "stop"
        elif len(self.tokens) >= self.request.max_tokens:
            self.finish = "length"
        return self.finish is not None

    def result(self) -> GenerationResult:
        return GenerationResult(self.tokens, self.logprobs, self.finish or "length")

    @property
    def order_key(self) -> tuple[bool, str]:
        return self.adapter is not None, self.adapter or ""


def make_row(
    request: GenerationRequest, adapter: str | None, eos_token_ids: list[int], tag: Any = None
) -> Row:
    stops = frozenset(eos_token_ids) | frozenset(request.stop_token_ids)
    return Row(request, adapter, stops, tag)


def _pad_left(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    extra = width - t.shape[dim]
    if extra == 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t.new_zeros(shape), t], dim=dim)


@dataclass
class _State:
    """Tensors of the rows, in row order: the cache covers `mask`'s columns; `next_ids`
    are the tokens sampled last, fed at the next step at positions `next_pos`."""

    cache: Any
    mask: torch.Tensor
    next_ids: torch.Tensor
    next_pos: torch.Tensor
    temperature: torch.Tensor
    top_p: torch.Tensor

    def select(self, index: torch.Tensor) -> None:
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, index)
            layer.values = layer.values.index_select(0, index)
        self.mask = self.mask.index_select(0, index)
        self.next_ids = self.next_ids.index_select(0, index)
        self.next_pos = self.next_pos.index_select(0, index)
        self.temperature = self.temperature.index_select(0, index)
        self.top_p = self.top_p.index_select(0, index)

    def trim(self) -> None:
        """Drop leading columns that no row attends to any more."""
        used = self.mask.any(dim=0)
        first = int(used.to(torch.int8).argmax()) if bool(used.any()) else 0
        if first == 0:
            return
        self.mask = self.mask[:, first:]
        for layer in self.cache.layers:
            layer.keys = layer.keys[:, :, first:, :]
            layer.values = layer.values[:, :, first:, :]

    def merge(self, other: _State) -> None:
        """Append `other`'s rows, both left-padded to the longer cache."""
        width = max(self.mask.shape[1], other.mask.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.keys = torch.cat([_pad_left(mine.keys, width, 2), _pad_left(theirs.keys, width, 2)])
            mine.values = torch.cat(
                [_pad_left(mine.values, width, 2), _pad_left(theirs.values, width, 2)]
            )
        self.mask = torch.cat([_pad_left(self.mask, width, 1), _pad_left(other.mask, width, 1)])
        self.next_ids = torch.cat([self.next_ids, other.next_ids])
        self.next_pos = torch.cat([self.next_pos, other.next_pos])
        self.temperature = torch.cat([self.temperature, other.temperature])
        self.top_p = torch.cat([self.top_p, other.top_p])


def _distinct_prompts(rows: list[Row]) -> tuple[list[Row], list[int]]:
    """The first row of each (adapter, prompt) in order, and each row's index among them."""
    first: dict[tuple[str | None, tuple[int, ...]], int] = {}
    distinct: list[Row] = []
    copies = []
    for row in rows:
        key = (row.adapter, tuple(row.request.prompt_token_ids))
        if key not in first:
            first[key] = len(distinct)
            distinct.append(row)
        copies.append(first[key])
    return distinct, copies


def _mergeable(cache: Any) -> bool:
    return all(type(layer) is DynamicLayer for layer in getattr(cache, "layers", [None]))


class RunningBatch:
    """The rows decoding together on one model; call from one thread only."""

    def __init__(self, model: torch.nn.Module, lora: MultiLoRA | None, pad_token_id: int):
        self.model = model
        self.lora = lora
        self.pad_token_id = pad_token_id
        self.device = next(model.parameters()).device
        self.rows: list[Row] = []
        self._state: _State | None = None
        self._cache_name = cache_argument(model)
        self._open = True
        """False while the rows' cache cannot take more rows (see the module docstring)."""

    def can_admit(self) -> bool:
        return not self.rows or self._open

    @torch.no_grad()
    def admit(self, rows: list[Row]) -> list[Row]:
        """Prefill `rows`, sample their first tokens and add the unfinished ones to the batch;
        returns the rows finished already. Raises (batch unchanged) if the prefill fails."""
        if not self.can_admit():
            raise RuntimeError("the running batch's cache cannot take new rows")
        rows = sorted(rows, key=lambda r: r.order_key)
        state, logits = self._prefill(rows)
        finished = self._sample_into(rows, state, logits)
        keep = [i for i, r in enumerate(rows) if r.finish is None]
        if not keep:
            return finished
        if len(keep) < len(rows):
            state.select(torch.tensor(keep, dtype=torch.long, device=self.device))
        added = [rows[i] for i in keep]
        if self._state is None or not self.rows:
            self._state, self.rows = state, added
            self._open = _mergeable(state.cache)
        else:
            self._state.merge(state)
            self.rows = self.rows + added
            order = sorted(range(len(self.rows)), key=lambda i: self.rows[i].order_key)
            if order != list(range(len(self.rows))):
                self._state.select(torch.tensor(order, dtype=torch.long, device=self.device))
                self.rows = [self.rows[i] for i in order]
        return finished

    @torch.no_grad()
    def step(self) -> list[Row]:
        """One decode step for every row; returns (and removes) the rows that finished."""
        state = self._state
        assert state is not None and self.rows
        mask = torch.cat([state.mask, state.mask.new_ones((len(self.rows), 1))], dim=-1)
        out = self._forward(self.rows, state.next_ids, mask, state.next_pos, state.cache)
        state.mask = mask
        state.next_pos = state.next_pos + 1
        state.cache = out[self._cache_name]
        return self._drop_finished(self._sample_into(self.rows, state, out.logits[:, -1, :]))

    def drop(self, rows: list[Row]) -> None:
        """Stop decoding `rows` (their callers went away)."""
        gone = {id(r) for r in rows}
        for r in self.rows:
            if id(r) in gone and r.finish is None:
                r.finish = "abandoned"
        self._drop_finished([r for r in self.rows if id(r) in gone])

    def clear(self) -> list[Row]:
        """Empty the batch (after a failed step); returns the rows it held."""
        rows, self.rows, self._state = self.rows, [], None
        return rows

    def _prefill(self, rows: list[Row]) -> tuple[_State, torch.Tensor]:
        """The newcomers' cache and state, and the logits their first tokens come from.

        Rows with the same prompt and adapter (a GRPO group's samples, Voting's
        generators) are prefilled once and their cache copied: the prefill is most of
        a short answer's cost, and a group of 8 would pay it 8 times."""
        distinct, copies = _distinct_prompts(rows)
        n = len(distinct)
        width = max(len(r.request.prompt_token_ids) for r in distinct)
        ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, r in enumerate(distinct):
            prompt = r.request.prompt_token_ids
            ids[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[i, width - len(prompt) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        out = self._forward(distinct, ids, mask, positions, None)
        state = _State(out[self._cache_name], mask, ids[:, -1:], positions[:, -1:] + 1,
                       *self._sampling(distinct))
        logits = out.logits[:, -1, :]
        if n < len(rows):
            pick = torch.tensor(copies, dtype=torch.long, device=self.device)
            state.select(pick)
            logits = logits.index_select(0, pick)
            state.temperature, state.top_p = self._sampling(rows)
        return state, logits

    def _sampling(self, rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's temperature and top-p (1 = off)."""
        temperature = torch.tensor([r.request.temperature for r in rows], device=self.device)
        top_p = torch.tensor(
            [r.request.top_p if 0 < r.request.top_p < 1 else 1.0 for r in rows],
            device=self.device,
        )
        return temperature, top_p

    def _forward(
        self,
        rows: list[Row],
        ids: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        cache: Any,
    ) -> Any:
        kwargs: dict[str, Any] = dict(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
        )
        kwargs[self._cache_name] = cache
        if self.lora is None:
            return self.model(**kwargs)
        with self.lora.route([r.adapter for r in rows]):
            return self.model(**kwargs)

    def _sample_into(self, rows: list[Row], state: _State, logits: torch.Tensor) -> list[Row]:
        """Sample each row's next token into `state.next_ids`; returns the rows it finished."""
        uniforms = row_uniforms([r.request.seed for r in rows], [len(r.tokens) for r in rows],
                                logits.device)
        tokens, logps = sample(logits, state.temperature, state.top_p, uniforms)
        state.next_ids = tokens[:, None]
        finished = []
        for row, tok, lp in zip(rows, tokens.tolist(), logps.tolist(), strict=True):
            if row.record(int(tok), float(lp)):
                finished.append(row)
        return finished

    def _drop_finished(self, finished: list[Row]) -> list[Row]:
        if not finished:
            return finished
        assert self._state is not None
        keep = [i for i, r in enumerate(self.rows) if r.finish is None]
        if not keep:
            self.clear()
            return finished
        self._state.select(torch.tensor(keep, dtype=torch.long, device=self.device))
        self._state.trim()
        self.rows = [self.rows[i] for i in keep]
        return finished


def cache_argument(model: torch.nn.Module) -> str:
    """What the model's forward calls its KV cache, in and out: `cache` from transformers
    5.24 on (which warns on the old name and will drop it), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def decode_all(
    model: torch.nn.Module,
    lora: MultiLoRA | None,
    requests: list[GenerationRequest],
    adapters: list[str | None],
    eos_token_ids: list[int],
    pad_token_id: int,
) -> list[GenerationResult]:
    """Decode `requests` as one batch to the end (no joins): tests and one-off callers."""
    batch = RunningBatch(model, lora, pad_token_id)
    rows = [make_row(r, a, eos_token_ids) for r, a in zip(requests, adapters, strict=True)]
    batch.admit(rows)
    while batch.rows:
        batch.step()
    return [r.result() for r in rows]
