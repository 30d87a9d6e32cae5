"""The training data order: deterministic from the seed, resumable from a position."""

from __future__ import annotations

import random

from marl.problem import Problem


class DataSampler:
    """Deterministic order over the training set: reshuffled per epoch from the seed."""

    def __init__(self, problems: list[Problem], seed: int, position: int = 0):
        self.problems = problems
        self.seed = seed
        self.position = position
        self._epoch_order: tuple[int, list[int]] | None = None

    def _order(self, epoch: int) -> list[int]:
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            idx = list(range(len(self.problems)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(idx)
            self._epoch_order = (epoch, idx)
        return self._epoch_order[1]

    def next(self, n: int) -> list[Problem]:
        """The next `n` distinct problems; a step that crosses an epoch boundary skips the
        new epoch's copies of problems it already holds (a repeated problem would share
        its task ids with the first copy and be dropped as a duplicate)."""
        out: list[Problem] = []
        seen: set[str] = set()
        distinct = n <= len(self.problems)
        while len(out) < n:
            epoch, offset = divmod(self.position, len(self.problems))
            problem = self.problems[self._order(epoch)[offset]]
            self.position += 1
            if distinct and problem.id in seen:
                continue
            seen.add(problem.id)
            out.append(problem)
        return out
