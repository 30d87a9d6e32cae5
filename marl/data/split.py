"""Deterministic train/validation splits and orders, from the seed and problem ids alone.

Problems are ranked by a hash of (seed, purpose, id), not shuffled in file
order, so a split and an order depend only on the seed and on which problems
there are: reordering the rows of a file, or reading it as several files,
changes neither.
"""

from __future__ import annotations

import hashlib

from marl.problem import Problem
from marl.spec.run import SpecError


def _rank(seed: int, purpose: str, problem: Problem) -> bytes:
    return hashlib.blake2b(f"{seed}\0{purpose}\0{problem.id}".encode(), digest_size=16).digest()


def ordered(problems: list[Problem], seed: int) -> list[Problem]:
    """`problems` in the order `seed` gives them."""
    return sorted(problems, key=lambda p: _rank(seed, "order", p))


def split(
    problems: list[Problem], seed: int, val_fraction: float, name: str,
    val_size: int | None = None, val_source: str | None = None,
) -> tuple[list[Problem], list[Problem]]:
    """(train, val): `val_size` problems, else `val_fraction` of them (at least one), held
    out, each in seed order; `val_source`: held out of the problems with that
    `data_source` only (DeepCoder's `deepcoder_primeintellect`)."""
    if len(problems) < 2:
        raise SpecError(f"field `data.val`: {name} has {len(problems)} problem(s), too few to "
                        "split into train and validation; name a separate validation set")
    pool = [p for p in problems if val_source is None or p.data_source == val_source]
    if not pool:
        raise SpecError(f"field `data.val_subset`: {name} has no {val_source} problem; check "
                        "that data.train_path holds that subset's files")
    wanted = val_size if val_size is not None else round(len(problems) * val_fraction)
    n_val = min(len(pool), len(problems) - 1, max(1, wanted))
    held = set(id(p) for p in sorted(pool, key=lambda p: _rank(seed, "split", p))[:n_val])
    return (ordered([p for p in problems if id(p) not in held], seed),
            ordered([p for p in problems if id(p) in held], seed))


def kept(problems: list[Problem], seed: int, val_size: int | None,
         val_source: str | None) -> list[Problem]:
    """A separate validation set's problems: those of `val_source` (all when None), the
    first `val_size` of them in seed order (all when None)."""
    pool = [p for p in problems if val_source is None or p.data_source == val_source]
    return ordered(pool, seed)[:val_size]
