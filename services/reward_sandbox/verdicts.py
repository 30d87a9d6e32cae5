"""Verdicts, decided outside the jail from plain values.

Stdout is compared the way programming-contest judges do: line endings are
normalised (CRLF and CR become LF), trailing whitespace at the end of every
line is ignored, and trailing empty lines (so a missing or extra final
newline) are ignored. Leading whitespace, blank lines in the middle and letter
case all count.

A function-call result is compared with the expected JSON value: tuples count
as lists, dict keys are compared as JSON keys (strings), a bool only equals a
bool, and numbers are equal when they are within 1e-9 (relative or absolute)
of each other if either is a float, exactly otherwise.
"""

from __future__ import annotations

import math
from typing import Any

_OUTCOME_VERDICT = {
    "failed": "FAILED",
    "not_plain": "FAILED",
    "compile_error": "COMPILE_ERROR",
    "runtime_error": "RUNTIME_ERROR",
    "timeout": "TIMEOUT",
    "memory": "MEMORY_LIMIT",
    "output_limit": "OUTPUT_LIMIT",
    "sandbox_error": "SANDBOX_ERROR",
}


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def stdout_matches(actual: str, expected: str) -> bool:
    return _lines(actual) == _lines(expected)


class _Unmatched(Exception):
    pass


def _jsonlike(v: Any) -> Any:
    t = type(v)
    if v is None or t in (bool, int, float, str):
        return v
    if t in (list, tuple):
        return [_jsonlike(x) for x in v]
    if t is dict:
        out = {}
        for k, x in v.items():
            if type(k) is str:
                key = k
            elif type(k) is bool or k is None:
                key = {True: "true", False: "false", None: "null"}[k]
            elif type(k) in (int, float):
                key = repr(k)
            else:
                raise _Unmatched
            out[key] = _jsonlike(x)
        return out
    raise _Unmatched


def _equal(got: Any, want: Any) -> bool:
    if type(got) is bool or type(want) is bool:
        return type(got) is type(want) and got == want
    if type(got) in (int, float) and type(want) in (int, float):
        if type(got) is int and type(want) is int:
            return got == want
        try:
            if math.isnan(got) and math.isnan(want):
                return True
            return math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)
        except OverflowError:  # an int past float's range is no float's near neighbour
            return False
    if type(got) is list and type(want) is list:
        return len(got) == len(want) and all(_equal(a, b) for a, b in zip(got, want, strict=True))
    if type(got) is dict and type(want) is dict:
        return got.keys() == want.keys() and all(_equal(got[k], want[k]) for k in got)
    return type(got) is type(want) and got == want


def values_equal(got: Any, expected: Any) -> bool:
    """`got` (a plain value from the jail) equals `expected` (parsed JSON)."""
    try:
        return _equal(_jsonlike(got), expected)
    except (_Unmatched, RecursionError):
        return False


def verdict(kind: str, outcome: str, *, stdout: str = "", expected_stdout: str = "",
            value: Any = None, expected: Any = None) -> str:
    """The verdict name for one test, from the harness's outcome and plain values."""
    if outcome != "ok":
        return _OUTCOME_VERDICT.get(outcome, "SANDBOX_ERROR")
    if kind == "stdio":
        return "PASSED" if stdout_matches(stdout, expected_stdout) else "FAILED"
    if kind == "call":
        return "PASSED" if values_equal(value, expected) else "FAILED"
    return "PASSED"
