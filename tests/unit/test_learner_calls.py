"""The learner's calls read by name: none passes more than six positional arguments, so
a call site says which value is which (logging's format arguments aside)."""

from __future__ import annotations

import ast
from pathlib import Path

LEARNER = Path(__file__).resolve().parents[2] / "services" / "learner"
MAX_POSITIONAL = 6
LOG_METHODS = {"debug", "info", "warning", "error", "exception", "critical"}


def wide_calls(source: str) -> list[tuple[int, str, int]]:
    """(line, callee, positional count) of every call over MAX_POSITIONAL."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Attribute) and node.func.attr in LOG_METHODS:
            continue
        positional = sum(not isinstance(a, ast.Starred) for a in node.args)
        if positional > MAX_POSITIONAL:
            found.append((node.lineno, ast.unparse(node.func), positional))
    return found


def test_the_check_sees_a_wide_call() -> None:
    assert wide_calls("f(1, 2, 3, 4, 5, 6, 7)") == [(1, "f", 7)]
    assert wide_calls("f(1, 2, 3, 4, 5, 6, g=7)") == []
    assert wide_calls("log.warning('%s %s %s %s %s %s', 1, 2, 3, 4, 5, 6)") == []


def test_no_learner_call_passes_more_than_six_positional_arguments() -> None:
    offenders = [
        f"{path.relative_to(LEARNER.parents[1])}:{line} {callee} ({n} positional)"
        for path in sorted(LEARNER.rglob("*.py"))
        for line, callee, n in wide_calls(path.read_text())
    ]
    assert offenders == [], "name these arguments:\n" + "\n".join(offenders)
