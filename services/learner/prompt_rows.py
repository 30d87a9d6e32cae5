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

On the demo model's arithmetic task (15-token prompts, ~5-token answers), a group of 8 is
55 positions instead of 160. The mask is dense, [rows, 1, L, L], and attention is
computed over all of a row, so a row is capped (`grpo.shared_prompt_row_tokens`): long
completions, where the prompt is a small part of the work, mostly get rows of their own.
A sequence longer than the cap always has a row to itself, laid out as without sharing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.learner.sequences import Sequence


@dataclass
class Rows:
    input_ids: torch.Tensor
    """[R, L] right-padded."""
    attention_mask: torch.Tensor
    """[R, L] padding mask when every row holds one sequence (the decoder builds the causal
    mask itself); else [R, 1, L, L] additive: 0 where a position may attend, the dtype's
    minimum where not."""
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


def layout(seqs: list[Sequence], pad_id: int, row_tokens: int, dtype: torch.dtype) -> Rows:
    """The decoder's input for `seqs` (see the module docstring); `dtype`: the model's, for
    the additive mask."""
    plan = plan_rows(seqs, row_tokens)
    width = max(row_width(seqs, row) for row in plan)
    n_rows = len(plan)
    shared = any(len(row) > 1 for row in plan)
    input_ids = torch.full((n_rows, width), pad_id, dtype=torch.long)
    where: list[tuple[int, torch.Tensor]] = [(0, torch.empty(0))] * len(seqs)
    if shared:
        allowed = torch.zeros((n_rows, width, width), dtype=torch.bool)
        positions = torch.zeros((n_rows, width), dtype=torch.long)
    else:
        padding = torch.zeros((n_rows, width), dtype=torch.long)
    for r, row in enumerate(plan):
        first = seqs[row[0]]
        p = first.n_prompt
        input_ids[r, :p] = torch.tensor(first.tokens[:p], dtype=torch.long)
        if shared:
            positions[r, :p] = torch.arange(p)
            allowed[r, :p, :p] = torch.ones((p, p), dtype=torch.bool).tril()
        else:
            padding[r, : len(first.tokens)] = 1
        at = p
        for i in row:
            completion = seqs[i].tokens[p:]
            n = len(completion)
            input_ids[r, at : at + n] = torch.tensor(completion, dtype=torch.long)
            if shared:
                positions[r, at : at + n] = torch.arange(p, p + n)
                allowed[r, at : at + n, :p] = True
                allowed[r, at : at + n, at : at + n] = torch.ones((n, n), dtype=torch.bool).tril()
            # its first token is predicted at the prompt's last position, token j at its j-1
            cols = torch.cat([torch.tensor([p - 1]), torch.arange(at, at + n - 1)])
            where[i] = (r, cols)
            at += n
        if shared:
            pad = torch.arange(at, width)
            allowed[r, pad, pad] = True  # padding attends to itself: no row of the softmax is empty
    lengths = [len(s.tokens) - s.n_prompt for s in seqs]
    rows = torch.cat([torch.full((len(c),), r, dtype=torch.long) for r, c in where])
    cols = torch.cat([c for _, c in where])
    targets = torch.cat([torch.tensor(s.tokens[s.n_prompt :], dtype=torch.long) for s in seqs])
    if shared:
        mask = torch.zeros((n_rows, 1, width, width), dtype=dtype)
        mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
        return Rows(input_ids, mask, positions, rows, cols, targets, lengths)
    return Rows(input_ids, padding, None, rows, cols, targets, lengths)


def pack_rows(
    seqs: list[Sequence], idx: list[int], max_seqs: int, max_tokens: int, row_tokens: int
) -> list[list[int]]:
    """`idx` cut into micro-batches of at most `max_seqs` sequences whose rows (as
    plan_rows lays them out) take at most `max_tokens` padded positions (rows x widest); a
    sequence over the budget gets a micro-batch of its own. Sequences with equal prompts
    are taken together, so they share rows; within a prompt, shortest first."""
    prompt = {i: tuple(seqs[i].tokens[: seqs[i].n_prompt]) for i in idx}
    order = sorted(idx, key=lambda i: (len(prompt[i]), prompt[i], len(seqs[i].tokens)))
    out: list[list[int]] = []
    cur: list[int] = []
    rows = widest = last = 0  # the current micro-batch's rows, its widest, its last one's width
    for i in order:
        s = seqs[i]
        grown = last + len(s.tokens) - s.n_prompt
        extends = bool(cur) and row_tokens > 0 and prompt[cur[-1]] == prompt[i]
        if extends and grown <= row_tokens:
            n_rows, width = rows, grown
        else:
            n_rows, width = rows + 1, len(s.tokens)
        if cur and (len(cur) >= max_seqs or n_rows * max(widest, width) > max_tokens):
            out.append(cur)
            cur, n_rows, widest, width = [], 1, 0, len(s.tokens)
        cur.append(i)
        rows, widest, last = n_rows, max(widest, width), width
    if cur:
        out.append(cur)
    return out
