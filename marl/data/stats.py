"""What a set's answers and tests look like, counted for `marl data inspect`."""

from __future__ import annotations

import re
import statistics
from collections import Counter

from marl.problem import Problem
from marl.rewards.answer_text import is_prose

_FORMATS: list[tuple[str, re.Pattern[str]]] = [
    ("integer", re.compile(r"-?\d+")),
    ("decimal", re.compile(r"-?\d*\.\d+")),
    ("fraction", re.compile(r"-?(?:\d+/\d+|\\[dt]?frac\{\d+\}\{\d+\})")),
    ("interval/tuple/set", re.compile(r"[\[({].*,.*[\])}]|\\\{.*\\\}")),
    ("equation", re.compile(r".*=.*")),
    ("latex expression", re.compile(r".*\\.*")),
]


def answer_format(answer: str) -> str:
    """A coarse label for one ground truth: integer, fraction, prose, ..."""
    text = answer.strip()
    if not text:
        return "empty"
    for label, pattern in _FORMATS:
        if pattern.fullmatch(text):
            return label
    return "prose" if is_prose(text) else "plain expression"


def answer_formats(problems: list[Problem]) -> Counter[str]:
    return Counter(answer_format(p.answer) for p in problems)


def kind_of_test(test: dict[str, object]) -> str:
    if "stdin" in test:
        return "stdin/stdout"
    if "fn_name" in test:
        return "function call"
    if "assert_program" in test:
        return "assert program"
    return "unknown"


def kinds_of_tests(problems: list[Problem]) -> Counter[str]:
    return Counter(kind_of_test(t) for p in problems for t in p.tests)


def count_tests(problems: list[Problem]) -> tuple[int, float, int]:
    """(min, median, max) number of tests per problem."""
    counts = [len(p.tests) for p in problems] or [0]
    return min(counts), statistics.median(counts), max(counts)
