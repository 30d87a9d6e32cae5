"""Math reward (paper §A.7): the last `\\boxed{}` of the final answer against the ground truth.

1.0 when the boxed answer is mathematically equivalent to the ground truth (as
math-verify judges it: fractions, decimals, LaTeX forms, units, `x = ` prefixes,
intervals, sets, percentages), 0.0 when it is not or when the check runs past its
time limit, and `format_penalty` when there is no boxed answer or it does not
parse. A ground truth written in words ("No integer solutions") is compared as
normalised text, since math-verify would read it as a product of letters (see
`marl.rewards.answer_text`).

The comparison runs in a worker process (`marl.rewards.verifier_pool`), so the
time limit holds from any thread and from asyncio code (`score_async`). Two integer
literals are the exception: they are compared here (`integer_verdict`).

An answer equal in value is correct however it is written (`2^{10}`, `2\\cdot 512`,
`8/2`, `1.024\\times 10^3` for 1024), except an expression the problem's own text writes
(`\\boxed{23+29}` for "What is 23+29?"): that restates the question rather than answering
it (`restates_the_question`).
"""

from __future__ import annotations

import asyncio
import functools
import math
import re
from decimal import Decimal
from typing import Literal

from marl.rewards.verifier_pool import get_pool

FORMAT_PENALTY = -0.1
TIMEOUT_S = 5.0
"""Default time limit for one comparison (RunSpec `reward.math_timeout_s`)."""

Verdict = Literal["correct", "wrong", "unparsed", "timeout", "error"]

_MACROS = ("\\boxed", "\\fbox")


def _macro_starts(text: str) -> list[tuple[int, str]]:
    """Positions of every `\\boxed` / `\\fbox` that is a whole command (not `\\boxedsomething`)."""
    starts = []
    for macro in _MACROS:
        i = text.find(macro)
        while i >= 0:
            after = text[i + len(macro) : i + len(macro) + 1]
            if not after.isalpha():
                starts.append((i, macro))
            i = text.find(macro, i + 1)
    return sorted(starts)


def _braced(text: str, start: int) -> str | None:
    """Content of the brace group opening at `start`, skipping escaped `\\{` `\\}`."""
    depth = 0
    j = start
    while j < len(text):
        ch = text[j]
        if ch == "\\":
            j += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : j]
        j += 1
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), nested braces included.

    `\\boxed 5` (a single token, no braces) counts too. None when there is no box
    or the last one is never closed (a truncated answer gave no final answer).
    """
    starts = _macro_starts(text)
    if not starts:
        return None
    i, macro = starts[-1]
    j = i + len(macro)
    while j < len(text) and text[j] in " \t":
        j += 1
    if j < len(text) and text[j] == "{":
        return _braced(text, j)
    token = text[j:].split(maxsplit=1)
    return (token[0].rstrip("$.,") or None) if token else None


def warm_up() -> None:
    """Start the verifier workers now rather than on the first `score` (about a second each)."""
    get_pool().warm()


VERDICTS_KEPT = 65536
"""Settled comparisons this process remembers (`check`); emptied when full."""
_verdicts: dict[tuple[str, str, float], Verdict] = {}


INTEGER = re.compile(r"[+-]?[0-9]{1,1000}")
"""An integer literal: ASCII digits (math-verify does not read other scripts' digits),
short enough for `int` (Python refuses strings of over 4300 digits)."""


def integer_verdict(pred: str, ground_truth: str) -> Verdict | None:
    """math-verify's verdict on two integer literals, without asking a worker: equal
    values (`007`, `+7` and `7`; `-0` and `0`) are correct, others wrong; None when
    either side is anything else. Integer answers are the common case (the demo's
    sums, every DAPO-Math answer), and a worker round trip costs far more CPU than this
    comparison; tests/unit/test_math_reward.py checks the verdicts
    against math-verify's."""
    pred, ground_truth = pred.strip(), ground_truth.strip()
    if not (INTEGER.fullmatch(pred) and INTEGER.fullmatch(ground_truth)):
        return None
    return "correct" if int(pred) == int(ground_truth) else "wrong"


_SPELLED = (
    (re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}"), r"(\1)/(\2)"),
    (re.compile(r"\\(?:times|cdot|ast)(?![a-zA-Z])|[×·]"), "*"),
    (re.compile(r"\\div(?![a-zA-Z])|÷"), "/"),
    (re.compile(r"\*\*"), "^"),
    (re.compile(r"\\(?:left|right)(?![a-zA-Z])|\\[,;!: ]|[\s${}]"), ""),
    (re.compile(r"\((-?[0-9.]+)\)"), r"\1"),
)
"""How an arithmetic expression is written, down to one spelling: `\\frac{8}{2}` as
`8/2`, `\\times` and `\\cdot` as `*`, `2^{10}` as `2^10`, no spaces or dollars."""

EXPRESSION = re.compile(r"[0-9.]+(?:[-+*/^][-(]*[0-9.]+\)*)+")
"""An arithmetic expression on numbers, as `spelled` writes it: two or more numbers joined
by operators (`23+29`, `2^10`, `8/2`, `1.5*10^3`)."""


def spelled(text: str) -> str:
    """`text` with arithmetic written one way (`_SPELLED`), so an answer and a problem that
    write the same expression differently (`2^{10}`, `2^10`) compare equal."""
    for pattern, replacement in _SPELLED:
        text = pattern.sub(replacement, text)
    return text


def _reduced_fraction(expression: str) -> bool:
    """`p/q` in lowest terms: a value as it is written, not an expression left to evaluate."""
    parts = re.fullmatch(r"-?([0-9]{1,30})/([0-9]{1,30})", expression)
    return parts is not None and math.gcd(int(parts[1]), int(parts[2])) == 1 and parts[2] != "1"


SCIENTIFIC = re.compile(r"([+-]?[0-9]{1,100}(?:\.[0-9]{1,100})?)(?:[eE]|\*10\^)([+-]?[0-9]{1,4})")
"""A number in scientific notation as `spelled` writes it: `1.024e3`, `1.024*10^3`."""


def plain_number(text: str) -> str | None:
    """A number in scientific notation written out in full (`1.024\\times 10^{3}` as
    `1024`, `1.2e-3` as `0.0012`), exactly; None for anything else. math-verify reads
    `1.024e3` as a product with the constant e, and compares a large power of ten in
    floating point (`6.02\\times 10^{23}` against its integer is wrong to it)."""
    parts = SCIENTIFIC.fullmatch(spelled(text))
    if parts is None or abs(int(parts[2])) > 400:
        return None
    value = Decimal(parts[1]).scaleb(int(parts[2]))
    plain = format(value, "f")
    return plain.rstrip("0").rstrip(".") if "." in plain else plain


def restates_the_question(pred: str, question: str) -> bool:
    """Whether the answer is an expression the problem's own text writes (`23+29` for
    "What is 23+29?", or `29+23`: one sum or product with its operands swapped): math-verify
    calls it equal to its value, so a policy can box the question and be paid for
    evaluating it (SmolLM2 learned exactly that, docs/real-models.md). An expression the
    problem does not write is compared by value (`2^{10}` for 1024, `8/2` for 4), and a
    fraction in lowest terms is a value (`1/2`), restated or not."""
    answer = spelled(pred).strip("()")
    if not EXPRESSION.fullmatch(answer) or _reduced_fraction(answer):
        return False
    text = spelled(question)
    forms = {answer}
    swapped = re.fullmatch(r"([0-9.]+)([+*])([0-9.]+)", answer)
    if swapped:
        forms.add(swapped[3] + swapped[2] + swapped[1])
    return any(re.search(rf"(?<![0-9])(?<![0-9]\.){re.escape(form)}(?![0-9])(?!\.[0-9])", text)
               for form in forms)


class Unsettled(Exception):
    """Raised instead of asking a verifier worker (`remembered_only`): the comparison is
    neither an exact match, nor two integers, nor remembered."""


def check(
    pred: str,
    ground_truth: str,
    timeout_s: float = TIMEOUT_S,
    *,
    remembered_only: bool = False,
    question: str = "",
) -> Verdict:
    """Compare one answer with the ground truth in a verifier worker, within `timeout_s`
    (two integer literals are compared here: `integer_verdict`). An answer that restates
    an expression of `question`, the problem's text, is wrong (`restates_the_question`).

    A settled verdict (correct, wrong, unparsed) is remembered: math-verify's judgement is
    a function of the two strings, and a group's samples, and `score` and
    `any_format_correct` of one answer, often ask the same comparison. A timeout or an
    error depends on the moment, and is asked again next time. The time limit is part of
    the key: a comparison settled within one limit may not be within a shorter one."""
    if question and restates_the_question(pred, question):
        return "wrong"
    pred, ground_truth = plain_number(pred) or pred, plain_number(ground_truth) or ground_truth
    integers = integer_verdict(pred, ground_truth)
    if integers is not None:
        return integers
    known = _verdicts.get((pred, ground_truth, timeout_s))
    if known is not None:
        return known
    if remembered_only:
        raise Unsettled(pred)
    reply = get_pool().call({"gold": ground_truth, "pred": pred}, timeout_s)
    if reply is None:
        return "timeout"
    verdict = reply["verdict"]
    assert verdict in ("correct", "wrong", "unparsed", "timeout", "error"), reply
    if verdict in ("correct", "wrong", "unparsed"):
        if len(_verdicts) >= VERDICTS_KEPT:
            _verdicts.clear()
        _verdicts[(pred, ground_truth, timeout_s)] = verdict
    return verdict  # type: ignore[return-value]


def score(
    response: str,
    ground_truth: str,
    format_penalty: float = FORMAT_PENALTY,
    timeout_s: float = TIMEOUT_S,
    *,
    remembered_only: bool = False,
    question: str = "",
) -> float:
    """1.0 if the last boxed answer equals the ground truth, 0.0 if not, penalty if none.
    `question`: the problem's text, whose own expressions are no answer (`check`).
    `remembered_only`: raise Unsettled rather than wait for a verifier worker."""
    boxed = last_boxed(response)
    if boxed is None or not boxed.strip():
        return format_penalty
    if boxed.strip() == ground_truth.strip():
        return 1.0
    verdict = check(boxed, ground_truth, timeout_s, remembered_only=remembered_only,
                    question=question)
    if verdict == "correct":
        return 1.0
    if verdict == "unparsed":
        return format_penalty
    return 0.0


def loose_answer(text: str) -> str | None:
    """The answer a reader would take from `text` whatever its format: the last boxed
    answer, else the last number written in it."""
    boxed = last_boxed(text)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    numbers = re.findall(r"-?\d+(?:\.\d+)?(?:/\d+)?", text)
    return numbers[-1] if numbers else None


def any_format_correct(
    response: str,
    ground_truth: str,
    timeout_s: float = TIMEOUT_S,
    *,
    remembered_only: bool = False,
    question: str = "",
) -> bool:
    """Whether the response holds the right answer even where the format is wrong
    (`The answer is 42` for 42): tells format learning apart from getting answers right."""
    answer = loose_answer(response)
    if answer is None:
        return False
    if answer == ground_truth.strip():
        return True
    return check(answer, ground_truth, timeout_s, remembered_only=remembered_only,
                 question=question) == "correct"


async def score_async(
    response: str,
    ground_truth: str,
    format_penalty: float = FORMAT_PENALTY,
    timeout_s: float = TIMEOUT_S,
    question: str = "",
) -> float:
    """`score` without blocking the event loop while the worker compares."""
    return await asyncio.to_thread(functools.partial(
        score, response, ground_truth, format_penalty, timeout_s, question=question))
