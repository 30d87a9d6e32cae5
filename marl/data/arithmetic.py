"""The demo's synthetic task: two-number addition with a `\\boxed{}` answer.

Small enough that a 0.5M-parameter model learns it on 2 cores in minutes, and
graded by the same math reward as real data.
"""

from __future__ import annotations

import random

from marl.problem import Problem

MAX_OPERAND = 50
VAL_PAIRS = 200
HELD_OUT_SEED = 0


def problem(a: int, b: int) -> Problem:
    return Problem(
        id=f"add-{a}-{b}",
        prompt=f"What is {a}+{b}?",
        answer=str(a + b),
        task="math",
    )


def split(seed: int) -> tuple[list[Problem], list[Problem]]:
    """All pairs a, b < MAX_OPERAND; the same VAL_PAIRS held out whatever the seed.

    The held-out pairs are fixed so that the shipped demo model, warm-started on the
    training pairs, has seen no run's validation problem; `seed` orders the training
    pairs only.
    """
    pairs = [(a, b) for a in range(MAX_OPERAND) for b in range(MAX_OPERAND)]
    random.Random(HELD_OUT_SEED).shuffle(pairs)
    train, val = pairs[:-VAL_PAIRS], pairs[-VAL_PAIRS:]
    random.Random(seed).shuffle(train)
    return [problem(a, b) for a, b in train], [problem(a, b) for a, b in val]
