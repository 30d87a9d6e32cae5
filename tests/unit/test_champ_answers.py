"""Every CHAMP answer, boxed, scores 1 against itself and a perturbed one scores 0.

CHAMP's 270 final answers, as `marl.data.champ_answers.ground_truth` writes them:
  208 are mathematics math-verify parses (numbers, expressions, sets, equations),
    2 are mathematics it reads only as a raw string, so it compares them exactly
      ("a(1\\pm \\sqrt{2}), a(1\\pm \\sqrt{5})/2" and "x(x-1)(x-2)...(x-2022)"),
   60 are prose (33 of them "Yes"/"No", others such as "No integer solutions"), which
      the math reward compares as normalised text (see `marl.rewards.answer_text`).
The self-check goes through the verifier (`check`), not the exact-string
shortcut that `score` takes first, so each answer really is parsed and compared.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest
from math_verify import parse
from sympy import Basic, MatrixBase

from marl.data import champ
from marl.data.champ_answers import ground_truth, to_latex
from marl.problem import Problem
from marl.rewards.answer_text import is_prose, normalize_text
from marl.rewards.math_scoring import check, score

PROBLEMS = champ.load()


def kind(answer: str) -> str:
    if is_prose(answer):
        return "prose"
    parsed = parse(f"\\boxed{{{answer}}}", parsing_timeout=None)  # type: ignore[arg-type]
    return "math" if any(isinstance(p, (Basic, MatrixBase)) for p in parsed) else "string"


def perturb(answer: str) -> str:
    """A different answer of the same shape: the last integer plus one, or the opposite."""
    if is_prose(answer):
        return {"no": "Yes", "yes": "No"}.get(normalize_text(answer), f"not {answer}")
    numbers = list(re.finditer(r"\d+", answer))
    if not numbers:
        return f"{answer}+1"
    last = numbers[-1]
    return answer[: last.start()] + str(int(last.group()) + 1) + answer[last.end() :]


def test_all_270_problems_load_with_answers() -> None:
    assert len(PROBLEMS) == 270
    assert len({p.id for p in PROBLEMS}) == 270
    assert all(p.answer.strip() and p.prompt.strip() and p.task == "math" for p in PROBLEMS)
    assert not any("@@" in p.answer or "@@" in p.prompt for p in PROBLEMS)


def test_answer_kinds_are_counted() -> None:
    kinds = Counter(kind(p.answer) for p in PROBLEMS)
    assert kinds == {"math": 208, "string": 2, "prose": 60}
    yes_no = sum(1 for p in PROBLEMS if normalize_text(p.answer) in ("yes", "no"))
    assert yes_no == 33


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: p.id)
def test_own_answer_scores_one_and_perturbed_scores_zero(problem: Problem) -> None:
    assert check(problem.answer, problem.answer) == "correct"
    wrong = perturb(problem.answer)
    assert wrong != problem.answer
    assert check(wrong, problem.answer) != "correct", wrong
    assert score(f"So the answer is $\\boxed{{{problem.answer}}}$.", problem.answer) == 1.0
    assert score(f"\\boxed{{{wrong}}}", problem.answer) in (0.0, -0.1)


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ("239", "239"),
        ("@@C(10, 5)@@, or equivalently @@252@@", "252"),
        ("@@5/14@@, or approximately 35.7%", "5/14"),
        ("@@C(n, 4)@@, or an equivalent form such as @@n(n-1)(n-2)(n-3)/4!@@",
         "n(n-1)(n-2)(n-3)/4!"),
        ("100 (i.e., all values)", "100"),
        ("0 (none of the values)", "0"),
        ("0 is the only possible value", "0"),
        ("-3 is the only possible value", "-3"),
        ("The limit exists and is equal to @@2/3@@", "2/3"),
        ("The only possible value for the limit is @@sqrt(a)@@", r"\sqrt{a}"),
        ("2 inequalities", "2"),
        ("At most 0 integer-valued zeros (i.e., no integer zeros)", "0"),
        ("At least 1 number", "1"),
        ("@@n@@ times", "n"),
        ("Exactly one", "1"),
        ("376 and 625", "376, 625"),
        ("1, 4 and 9", "1, 4, 9"),
        ("@@x=0, y=2@@ and @@x=9, y=11@@", "(x=0, y=2), (x=9, y=11)"),
        ("@@x=16@@ and @@x=81@@", "x=16, x=81"),
        ("@@2^(n-1)@@", "2^{n-1}"),
        ("@@x=±1@@", r"x=\pm 1"),
        ("No", "No"),
        ("No integer solutions", "No integer solutions"),
        ("@@f(x)=0@@ or @@f(x)=1@@", "f(x)=0 or f(x)=1"),
        ("Yes, and the sequence is @@1/2^3, 1/2^6@@", "Yes, and the sequence is 1/2^3, 1/2^6"),
    ],
)
def test_ground_truth_rules(raw: str, want: str) -> None:
    assert ground_truth(raw) == want


def test_notation_to_latex() -> None:
    assert to_latex("2^floor(n/2)*floor(n/2)!") == r"2^{\lfloor n/2 \rfloor}*\lfloor n/2 \rfloor!"
    assert to_latex("sum_(k=1)^n 1/k") == r"\sum_{k=1}^{n} 1/k"
    assert to_latex("C(n+1, 2m+1)") == r"\binom{n+1}{2m+1}"
    assert to_latex("(1+sqrt(4a+1))/2") == r"(1+\sqrt{4a+1})/2"
    assert to_latex("x^3−x^2+1") == "x^3-x^2+1"


def test_model_style_answers_match_champ_ground_truths() -> None:
    """The forms a model writes, against CHAMP answers of each kind."""
    by_id = {p.id: p.answer for p in PROBLEMS}
    assert score(r"\boxed{\binom{10}{5}}", by_id["P_Combinatorics_2"]) == 1.0
    assert score(r"\boxed{2^{n-1}}", by_id["P_Combinatorics_6"]) == 1.0
    assert score(r"\boxed{\frac{\sqrt{3}}{3}}", by_id["P_Inequality_18"]) == 1.0
    assert score(r"\boxed{\{625, 376\}}", by_id["P_Number-Theory_3"]) == 1.0
    assert score(r"\boxed{(0, 2), (9, 11)}", by_id["P_Number-Theory_39"]) == 1.0
    assert score(r"\boxed{\pm 1}", by_id["P_Polynomial_22"]) == 1.0
    assert score(r"\boxed{\text{no}}", by_id["P_Combinatorics_17"]) == 1.0
    assert score(r"\boxed{1}", by_id["P_Inequality_12"]) == 0.0  # the harmonic sum, not 1
