"""Which candidate answers agree: the key two answers share when they say the same thing.

Used only for episode facts (Voting's majority, Orch-Workers' agreement), never
for the reward. Math: the last `\\boxed{}` with spaces removed; code: the last
Python block with blank lines and trailing spaces dropped. No key, no vote.
"""

from __future__ import annotations

from collections import Counter

from marl.rewards.code_scoring import extract_code
from marl.rewards.math_scoring import last_boxed


def answer_key(text: str, task: str) -> str | None:
    if task == "code":
        code = extract_code(text)
        if code is None:
            return None
        return "\n".join(line.rstrip() for line in code.splitlines() if line.strip())
    boxed = last_boxed(text)
    return None if boxed is None else "".join(boxed.split())


def majority(keys: list[str | None]) -> tuple[str | None, int]:
    """The most common key among the answers that have one and its count; (None, 0) if none.
    A tie goes to the answer given first."""
    counts = Counter(k for k in keys if k is not None)
    if not counts:
        return None, 0
    top = max(counts.values())
    first = next(k for k in keys if k is not None and counts[k] == top)
    return first, top
