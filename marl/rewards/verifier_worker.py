"""The math-verify worker process: one JSON request per stdin line, one JSON reply per line.

Started by `marl.rewards.verifier_pool` as `python -m marl.rewards.verifier_worker`.
It runs math-verify in its own main thread, so a soft deadline can use
`signal.setitimer`; a computation stuck in C code (a huge integer power) ignores
signals, and for that the parent kills this process outright. An address-space
limit turns runaway allocations into a MemoryError instead of a swapping host.

Request: {"gold": str, "pred": str, "timeout_s": float}
Reply:   {"verdict": "correct" | "wrong" | "unparsed" | "timeout" | "error"}
"""

from __future__ import annotations

import json
import logging
import resource
import signal
import sys
from types import FrameType

MEMORY_LIMIT_BYTES = 2 << 30


class _Deadline(BaseException):
    """Raised by the soft timer; a BaseException so library `except Exception` cannot eat it."""


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    raise _Deadline()


def judge(gold: str, pred: str) -> str:
    """Compare two boxed-answer strings: as text if the gold is prose, else with math-verify."""
    from math_verify import parse, verify
    from sympy import Basic, MatrixBase

    from marl.rewards.answer_text import is_prose, normalize_text

    if is_prose(gold):
        return "correct" if normalize_text(gold) == normalize_text(pred) else "wrong"
    gold_parsed = parse(f"\\boxed{{{gold}}}", parsing_timeout=None)  # type: ignore[arg-type]
    pred_parsed = parse(f"\\boxed{{{pred}}}", parsing_timeout=None)  # type: ignore[arg-type]
    if verify(gold_parsed, pred_parsed, timeout_seconds=None):
        return "correct"
    # parse() falls back to the raw string when it cannot read the mathematics;
    # such an answer only ever matches a gold that is the same raw string.
    if not any(isinstance(p, (Basic, MatrixBase)) for p in pred_parsed):
        return "unparsed"
    return "wrong"


def _answer(request: dict[str, object]) -> str:
    timeout_s = float(request["timeout_s"])  # type: ignore[arg-type]
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return judge(str(request["gold"]), str(request["pred"]))
    except _Deadline:
        return "timeout"
    except Exception:  # noqa: BLE001 - any verifier failure on odd input is a wrong answer
        return "error"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def main() -> None:
    try:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    except (ValueError, OSError):
        pass  # a lower hard limit is already in place
    logging.disable(logging.WARNING)  # math-verify warns on every disabled timeout
    signal.signal(signal.SIGALRM, _on_alarm)
    import math_verify  # noqa: F401 - import before the first request, not inside its deadline

    import marl.rewards.answer_text  # noqa: F401

    # math-verify builds its parsers on first use: here, not in a run's
    # step; an expression of symbols takes the slowest path, and LaTeX is cheap after it
    judge("1", "2a")
    sys.stdout.write('{"ready": true}\n')
    sys.stdout.flush()
    for line in sys.stdin:
        try:
            verdict = _answer(json.loads(line))
        except _Deadline:  # the timer fired between judge() and its cancellation
            verdict = "timeout"
        sys.stdout.write(json.dumps({"verdict": verdict}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
