"""Forward rows in which the sequences of a micro-batch that share a prompt share it once.

A GRPO group's samples all answer one prompt, and so do a workflow's parallel roles
(Voting's generators). One sequence per row, the decoder runs that prompt once per
sample. Here a row holds the prompt once, then the completions of the micro-batch's
sequences that have it, one after another. A block mask lets each completion attend to
the prompt and to its own earlier tokens only, and its position ids restart where the
prompt ends. So every completion token gets the features it would get in a row of its
own, the same numbers up to float rounding. The gradient that reaches the prompt's
positions is the sum of what each completion sends back, as it is when the prompt is run
once per sequence.

On the demo model's arithmetic task (15-token prompts, 5-token answers), a group of 8 is
55 positions instead of 160. The mask is dense, [rows, 1, L, L], and attention is
computed over all of a row, so a row is capped (`grpo.shared_prompt_row_tokens` and the
micro-batch budget): completions of hundreds of tokens, where the prompt is a small part
of the work, share a row with few others or none. A sequence longer than the cap has a
row to itself.

Blocks (a prompt and the completions that share it) of different prompts are then packed
side by side into rows no wider than the widest block (`pack_blocks`), each attending
within itself, its positions counted from 0: the micro-batch is padded to its widest row
either way, so a short block beside another fills what would be padding, in fewer rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.learner.sequences import Sequence

if TYPE_CHECKING:
    from services.learner.varlen import VarlenLayout


@dataclass
class Rows:
    input_ids: torch.Tensor
    """[R, L] right-padded."""
    attention_mask: torch.Tensor | None
    """[R, L] padding mask when every row holds one sequence (the decoder builds the causal
    mask itself); else [R, 1, L, L] additive: 0 where a position may attend, the dtype's
    minimum where not; None in a varlen row (`varlen`)."""
    position_ids: torch.Tensor | None
    """[R, L] where rows are shared; None otherwise (positions 0..L-1)."""
    rows: torch.Tensor
    """[N]: the row of each position that predicts a completion token, sequences in the
    order given, each one's tokens in order."""
    cols: torch.Tensor
    """[N]: the column of that position."""
    targets: torch.Tensor
    """[N]: the completion token predicted there."""
    lengths: list[int]
    """Completion tokens per sequence, in the order given."""
    varlen: VarlenLayout | None = None
    """The segments of a single varlen row (varlen.varlen_rows); None for dense rows."""


def plan_rows(seqs: list[Sequence], row_tokens: int) -> list[list[int]]:
    """Indices into `seqs` per row: sequences with equal prompts fill rows of at most
    `row_tokens` positions (the prompt once plus their completions), in first-seen order.
    `row_tokens` 0: one sequence per row."""
    if row_tokens <= 0:
        return [[i] for i in range(len(seqs))]
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for i, s in enumerate(seqs):
        by_prompt.setdefault(tuple(s.tokens[: s.n_prompt]), []).append(i)
    out: list[list[int]] = []
    for members in by_prompt.values():
        row: list[int] = []
        width = 0
        for i in members:
            s = seqs[i]
            grown = (width or s.n_prompt) + len(s.tokens) - s.n_prompt
            if row and grown > row_tokens:
                out.append(row)
                row, grown = [], len(s.tokens)
            row.append(i)
            width = grown
        out.append(row)
    return out


def row_width(seqs: list[Sequence], row: list[int]) -> int:
    first = seqs[row[0]]
    return first.n_prompt + sum(len(seqs[i].tokens) - seqs[i].n_prompt for i in row)


def pack_blocks(seqs: list[Sequence], blocks: list[list[int]]) -> list[list[list[int]]]:
    """`blocks` (plan_rows' rows: a prompt and the completions that share it) bin-packed
    into rows no wider than the widest block, first fit in decreasing width: a
    micro-batch is padded to its widest row, so short blocks fill what would be padding
    beside each other, and the forward has as few rows as fit, never wider ones."""
    widths = [row_width(seqs, b) for b in blocks]
    capacity = max(widths, default=0)
    rows: list[list[list[int]]] = []
    free: list[int] = []
    for b in sorted(range(len(blocks)), key=lambda b: -widths[b]):
        for r, room in enumerate(free):
            if widths[b] <= room:
                rows[r].append(blocks[b])
                free[r] -= widths[b]
                break
        else:
            rows.append([blocks[b]])
            free.append(capacity - widths[b])
    return rows


PROMPT, PADDING = -1, -2
"""Segment ids of a row's prompt positions and its padding; completions count from 0."""


def layout(seqs: list[Sequence], pad_id: int, row_tokens: int, dtype: torch.dtype) -> Rows:
    """The decoder's input for `seqs` (see the module docstring); `dtype`: the model's, for
    the additive mask. With `row_tokens` > 0, blocks of a prompt and its completions are
    also packed side by side (pack_blocks), each attending within itself alone, its
    positions counted from 0. Built as flat lists and made tensors once: a micro-batch
    holds up to `grpo.micro_batch_sequences` sequences, and a few small tensor operations
    per sequence would cost more than the lists."""
    blocks = plan_rows(seqs, row_tokens)
    plan = pack_blocks(seqs, blocks) if row_tokens > 0 else [[b] for b in blocks]
    width = max(sum(row_width(seqs, b) for b in row) for row in plan)
    shared = any(len(row) > 1 or len(row[0]) > 1 for row in plan)
    ids: list[list[int]] = []
    segments: list[list[int]] = []
    block_of: list[list[int]] = []
    positions: list[list[int]] = []
    where: list[tuple[int, list[int]]] = [(0, [])] * len(seqs)
    for r, row in enumerate(plan):
        row_ids: list[int] = []
        row_segments: list[int] = []
        row_blocks: list[int] = []
        row_positions: list[int] = []
        k = 0
        for b, block in enumerate(row):
            p = seqs[block[0]].n_prompt
            row_ids += seqs[block[0]].tokens[:p]
            row_segments += [PROMPT] * p
            row_positions += range(p)
            prompt_end = len(row_ids)
            for i in block:
                completion = seqs[i].tokens[p:]
                n, at = len(completion), len(row_ids)
                # its first token is predicted at the prompt's last position, token j at its j-1
                where[i] = (r, [prompt_end - 1, *range(at, at + n - 1)])
                row_ids += completion
                row_segments += [k] * n
                row_positions += range(p, p + n)
                k += 1
            row_blocks += [b] * (len(row_ids) - len(row_blocks))
        pad = width - len(row_ids)
        ids.append(row_ids + [pad_id] * pad)
        segments.append(row_segments + [PADDING] * pad)
        block_of.append(row_blocks + [PADDING] * pad)
        positions.append(row_positions + [0] * pad)
    input_ids = torch.tensor(ids, dtype=torch.long)
    seg = torch.tensor(segments, dtype=torch.long)
    rows = torch.tensor([r for r, cols in where for _ in cols], dtype=torch.long)
    cols = torch.tensor([c for _, cs in where for c in cs], dtype=torch.long)
    targets = torch.tensor([t for s in seqs for t in s.tokens[s.n_prompt :]], dtype=torch.long)
    lengths = [len(s.tokens) - s.n_prompt for s in seqs]
    if not shared:
        padding = (seg != PADDING).long()
        return Rows(
            input_ids, padding, None, rows=rows, cols=cols, targets=targets, lengths=lengths
        )
    # query q may attend to key k <= q of its own block's prompt or of q's own completion;
    # padding attends to itself alone, so that no row of the softmax is empty
    query, key = seg[:, :, None], seg[:, None, :]
    blk = torch.tensor(block_of, dtype=torch.long)
    same_block = blk[:, :, None] == blk[:, None, :]
    causal = torch.ones((width, width), dtype=torch.bool).tril()
    allowed = causal & same_block & ((key == PROMPT) | (key == query))
    allowed = torch.where(query == PADDING, torch.eye(width, dtype=torch.bool), allowed)
    mask = torch.zeros((len(plan), 1, width, width), dtype=dtype)
    mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
    return Rows(
        input_ids, mask, torch.tensor(positions), rows=rows, cols=cols, targets=targets,
        lengths=lengths,
    )


def pack_rows(
    seqs: list[Sequence],
    idx: list[int],
    max_seqs: int,
    max_tokens: int,
    row_tokens: int,
    *,
    varlen: bool = False,
) -> list[list[int]]:
    """`idx` cut into micro-batches of at most `max_seqs` sequences whose rows (as
    plan_rows lays them out) take at most `max_tokens` padded positions (rows x widest;
    with `varlen`, one row of them all with no padding: their positions summed,
    varlen.py); a sequence over the budget gets a micro-batch of its own. Sequences with
    equal prompts are taken together, so they share rows; within a prompt, shortest
    first."""
    prompt = {i: tuple(seqs[i].tokens[: seqs[i].n_prompt]) for i in idx}
    order = sorted(idx, key=lambda i: (len(prompt[i]), prompt[i], len(seqs[i].tokens)))
    out: list[list[int]] = []
    cur: list[int] = []
    # the current micro-batch's rows, its widest, its last one's width, its positions
    rows = widest = last = total = 0
    for i in order:
        s = seqs[i]
        grown = last + len(s.tokens) - s.n_prompt
        extends = bool(cur) and row_tokens > 0 and prompt[cur[-1]] == prompt[i]
        if extends and grown <= row_tokens:
            n_rows, width, n_total = rows, grown, total + grown - last
        else:
            n_rows, width, n_total = rows + 1, len(s.tokens), total + len(s.tokens)
        cost = n_total if varlen else n_rows * max(widest, width)
        if cur and (len(cur) >= max_seqs or cost > max_tokens):
            out.append(cur)
            cur, n_rows, widest, width, n_total = [], 1, 0, len(s.tokens), len(s.tokens)
        cur.append(i)
        rows, widest, last, total = n_rows, max(widest, width), width, n_total
    if cur:
        out.append(cur)
    return out
