"""Deterministic train/validation splits and orders, from the seed and problem ids alone.

Problems are ranked by a hash of (seed, purpose, id), not shuffled in file
order, so a split and an order depend only on the seed and on which problems
there are: reordering the rows of a file, or reading it as several files,
changes neither.
"""

from __future__ import annotations

import hashlib

from marl.data.problem import Problem
from marl.spec.run import SpecError


def _rank(seed: int, purpose: str, problem: Problem) -> bytes:
    return hashlib.blake2b(f"{seed}\0{purpose}\0{problem.id}".encode(), digest_size=16).digest()


def ordered(problems: list[Problem], seed: int) -> list[Problem]:
    """`problems` in the order `seed` gives them."""
    return sorted(problems, key=lambda p: _rank(seed, "order", p))


def split(
    problems: list[Problem], seed: int, val_fraction: float, name: str
) -> tuple[list[Problem], list[Problem]]:
    """(train, val): `val_fraction` of the problems (at least one) held out, each in seed order."""
    if len(problems) < 2:
        raise SpecError(f"field `data.val`: {name} has {len(problems)} problem(s), too few to "
                        "split into train and validation; name a separate validation set")
    n_val = min(len(problems) - 1, max(1, round(len(problems) * val_fraction)))
    ranked = sorted(problems, key=lambda p: _rank(seed, "split", p))
    return ordered(ranked[n_val:], seed), ordered(ranked[:n_val], seed)
