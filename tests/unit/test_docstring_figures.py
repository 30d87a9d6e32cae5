"""No docstring quotes a measured figure: a measurement goes on docs/benchmarks.md with its
command, host and date (bench/*.py --save), where the next run replaces it; a docstring
names the bench instead."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MEASURED_ON = re.compile(r"bench/|\bmeasured\b|\bbenchmark|on \d+ cores|\bH[12]00\b|demo.model|demo's")
"""What says a sentence reports a run: a bench, a host, the demo model."""
FIGURE = re.compile(r"(~|≈|about )\s?\d|\d(\.\d+)?\s?(ms|%)(?!\w)|\d[\d,]*\s(faults|tokens/s)|\d(\.\d+)?×")
"""An approximate or timed quantity: ~N, about N, N ms, N %, N faults, N tokens/s, N×."""


def quoted_figures(source: str) -> list[tuple[int, str]]:
    """(line, sentence) of each docstring sentence that reports a run with a figure."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            continue
        if not isinstance(node.value.value, str):
            continue
        for sentence in re.split(r"[.;]\s|\n\s*\n", node.value.value):
            if MEASURED_ON.search(sentence) and FIGURE.search(sentence):
                found.append((node.lineno, " ".join(sentence.split())))
    return found


def test_the_check_sees_a_quoted_figure() -> None:
    assert quoted_figures('"""Sent together: ~40 ms on 2 cores (bench/x.py)."""') == [
        (1, "Sent together: ~40 ms on 2 cores (bench/x.py).")
    ]
    assert quoted_figures('"""Waits 5 s; bench/x.py measures the step."""') == []
    assert quoted_figures('"""The walk cost 2.5 % of a demo-model update."""') != []


def test_no_docstring_quotes_a_benchmark_figure() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {sentence}"
        for package in ("marl", "services")
        for path in sorted((ROOT / package).rglob("*.py"))
        if "/v1/" not in path.as_posix()
        for line, sentence in quoted_figures(path.read_text())
    ]
    assert offenders == [], "move these figures to a bench and docs/benchmarks.md:\n" + "\n".join(
        offenders
    )
