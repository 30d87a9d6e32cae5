"""How a step's sequences are cut for the update: mini-batches, micro-batches, ranks.

A mini-batch is one optimizer step of one adapter: `grpo.mini_batch_size` problems x
`grpo.group_size` sequences, verl's count, shuffled afresh every epoch. A micro-batch is
one forward and backward: role-pure, bounded in sequences and padded positions, with the
sequences that share a prompt sharing forward rows (prompt_rows.py). Under FSDP each rank
takes a share of a mini-batch's micro-batches, and every rank runs as many of them.
"""

from __future__ import annotations

import itertools
import random
from collections import defaultdict
from collections.abc import Iterator

from marl.spec.run import GRPOSpec
from services.learner import fsdp
from services.learner.prompt_rows import pack_rows
from services.learner.sequences import Sequence

Chunk = tuple[list[int], bool]
"""A micro-batch (indices into the step's sequences) and whether it is real: a rank short
of work repeats one with `real` False, its loss weighted 0."""


def plan_mini_batches(
    seqs: list[Sequence],
    size: int,
    epochs: int,
    rng: random.Random,
    units: list[int] | None = None,
) -> dict[str, list[list[int]]]:
    """Adapter -> its mini-batches (indices into `seqs`), each epoch freshly shuffled.

    Under SP every role's turns are in one adapter's stream; under IP each adapter
    has its own, and its number of optimizer steps is about turns / size per epoch: a
    remainder under half of `size` joins the mini-batch before it (`cut`).
    `units` (`grpo.parallel_slots: pool`): sequences with the same unit id count as one
    sample, go to the same mini-batch, and a mini-batch holds `size` units.
    """
    by_policy: dict[str, list[int]] = defaultdict(list)
    for i, s in enumerate(seqs):
        by_policy[s.policy].append(i)
    plan: dict[str, list[list[int]]] = {}
    for p in sorted(by_policy):
        mbs = []
        if units is None:
            for _ in range(epochs):
                order = list(by_policy[p])
                rng.shuffle(order)
                mbs += cut(order, size)
        else:
            members: dict[int, list[int]] = defaultdict(list)
            for i in by_policy[p]:
                members[units[i]].append(i)
            for _ in range(epochs):
                keys = list(members)
                rng.shuffle(keys)
                mbs += [[i for u in part for i in members[u]] for part in cut(keys, size)]
        plan[p] = mbs
    return plan


def cut(items: list[int], size: int) -> list[list[int]]:
    """`items` in runs of `size`, a last run shorter than half of `size` joined to the one
    before: 513 sequences at 512 make one mini-batch of 513, not an optimizer step of 512
    and a full optimizer step on 1 (whose gradient, a mean over one sequence, is as large
    as a whole mini-batch's and far noisier). 768 at 512 stay [512, 256]."""
    runs = [items[k : k + size] for k in range(0, len(items), size)]
    if len(runs) > 1 and 2 * len(runs[-1]) < size:
        last = runs.pop()
        runs[-1] += last
    return runs


def pooled_units(seqs: list[Sequence], owners: list[int], parallel: tuple[str, ...]) -> list[int]:
    """`parallel_slots: pool`: a parallel role's turns of one rollout share a unit id."""
    ids: dict[tuple[int, str], int] = {}
    units = []
    for i, (s, k) in enumerate(zip(seqs, owners, strict=True)):
        key = (k, s.role) if s.role in parallel else (-1 - i, s.role)
        units.append(ids.setdefault(key, len(ids)))
    return units


def micro_batches(
    seqs: list[Sequence],
    idx: list[int],
    size: int,
    max_tokens: int,
    row_tokens: int,
    *,
    varlen: bool = False,
) -> list[list[int]]:
    """Role-pure micro-batches, at most `size` sequences and `max_tokens` padded positions
    each, sequences with the same prompt together (they share forward rows up to
    `row_tokens` positions, prompt_rows.py), then by length: little padding, bounded
    memory, and each role's part of the gradient can be read apart. `varlen`: positions
    as one varlen row counts them (prompt_rows.pack_rows)."""
    by_role: dict[str, list[int]] = defaultdict(list)
    for i in idx:
        by_role[seqs[i].role].append(i)
    out = []
    for role in sorted(by_role):
        out += pack_rows(seqs, by_role[role], size, max_tokens, row_tokens, varlen=varlen)
    return out


def rank_chunks(seqs: list[Sequence], chunks: list[list[int]], rank: int, size: int) -> list[Chunk]:
    """This rank's part of `chunks`, as many on every rank. With FSDP every forward
    gathers each layer's shards from all ranks, so the ranks must run the same number of
    them: a rank short of work repeats a chunk (not real). Chunks are split by padded
    tokens, role by role, so at every position of the list all ranks back-propagate the
    same role."""
    if size == 1:
        return [(c, True) for c in chunks]
    out: list[Chunk] = []
    for role in dict.fromkeys(seqs[c[0]].role for c in chunks):
        of_role = [c for c in chunks if seqs[c[0]].role == role]
        loads = [len(c) * max(len(seqs[i].tokens) for i in c) for c in of_role]
        parts = [fsdp.share(loads, r, size) for r in range(size)]
        mine = [(of_role[k], True) for k in parts[rank]]
        filler = min(of_role, key=lambda c: loads[of_role.index(c)])
        out += mine + [(filler, False)] * (max(map(len, parts)) - len(mine))
    return out


def forward_chunks(
    seqs: list[Sequence],
    idx: list[int],
    g: GRPOSpec,
    rank: int,
    size: int,
    *,
    varlen: bool = False,
) -> list[Chunk]:
    """`idx` as this rank's micro-batches under `g`'s bounds (`micro_batch_sequences`,
    `max_tokens_per_micro_batch`, the shared-prompt row cap); `varlen`: for varlen rows."""
    chunks = micro_batches(
        seqs, idx, g.micro_batch_sequences, g.max_tokens_per_micro_batch, g.row_tokens,
        varlen=varlen,
    )
    return rank_chunks(seqs, chunks, rank, size)


def by_role(seqs: list[Sequence], chunks: list[Chunk]) -> Iterator[tuple[str, list[Chunk]]]:
    """`chunks` in runs of one role each (they come role by role), with the role."""
    for role, run in itertools.groupby(chunks, key=lambda c: seqs[c[0][0]].role):
        yield role, list(run)
