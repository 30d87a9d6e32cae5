"""The math reward: a table of answer pairs, the box extraction, and the time limit."""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from marl.rewards import math_scoring as math_reward
from marl.rewards.math_scoring import FORMAT_PENALTY, last_boxed, score, score_async, warm_up
from marl.rewards.verifier_pool import GRACE_S, VerifierPool
from tests.support.loop_ticks import loop_ticks

P = FORMAT_PENALTY

# (response, ground truth, expected reward)
PAIRS: list[tuple[str, str, float]] = [
    # fractions
    (r"\boxed{\frac{1}{2}}", "1/2", 1),
    (r"\boxed{\dfrac{3}{4}}", "0.75", 1),
    (r"\boxed{2/4}", r"\frac12", 1),
    (r"\boxed{\tfrac{5}{10}}", "1/2", 1),
    (r"\boxed{-0.5}", r"-\frac{1}{2}", 1),
    (r"\boxed{0.33}", r"\frac{1}{3}", 0),
    (r"\boxed{\frac{3}{2}}", r"\frac{2}{3}", 0),
    # decimals
    (r"\boxed{0.5}", "1/2", 1),
    (r"\boxed{3.0}", "3", 1),
    (r"\boxed{2.5}", "5/2", 1),
    (r"\boxed{0.125}", "1/8", 1),
    (r"\boxed{0.333333}", r"\frac13", 1),
    (r"\boxed{1,000}", "1000", 1),
    (r"\boxed{3.14}", r"\pi", 0),
    # LaTeX forms
    (r"\boxed{\sqrt{18}}", r"3\sqrt{2}", 1),
    (r"\boxed{\frac{1}{\sqrt{3}}}", r"\frac{\sqrt{3}}{3}", 1),
    (r"\boxed{1024}", "2^{10}", 1),
    (r"\boxed{(x+1)^2}", "x^2+2x+1", 1),
    (r"\boxed{\frac{\pi}{2}}", r"\pi/2", 1),
    (r"\boxed{\left(\frac{1}{2}\right)}", "1/2", 1),
    (r"\boxed{\binom{5}{2}}", "10", 1),
    (r"\boxed{\dfrac{10!}{8!}}", "90", 1),
    (r"\boxed{\infty}", r"\infty", 1),
    (r"\boxed{2}", r"\sqrt{2}", 0),
    (r"\boxed{x^3}", "x^2", 0),
    # units
    (r"\boxed{5 \text{ cm}}", "5", 1),
    (r"\boxed{10\text{ meters}}", "10", 1),
    (r"\boxed{90^\circ}", "90", 1),
    (r"\boxed{\$12}", "12", 1),
    (r"\boxed{3\ \mathrm{kg}}", "3", 1),
    (r"\boxed{5}", r"5\text{ cm}", 1),
    (r"\boxed{5\text{ cm}}", "6", 0),
    # `x = ` prefixes
    (r"\boxed{x = 5}", "5", 1),
    (r"\boxed{5}", "x=5", 1),
    (r"\boxed{y = 2x+1}", "2x+1", 1),
    (r"\boxed{x=-2}", "-2", 1),
    (r"\boxed{k = \frac{1}{2}}", "0.5", 1),
    (r"\boxed{x = 4}", "5", 0),
    # intervals
    (r"\boxed{[1, 2)}", "[1,2)", 1),
    (r"\boxed{(-\infty,3]}", r"(-\infty, 3]", 1),
    (r"\boxed{(-\infty, 3]}", r"x \le 3", 1),
    (r"\boxed{(0,\infty)}", r"(0, \infty)", 1),
    (r"\boxed{\left[2, 5\right]}", "[2,5]", 1),
    (r"\boxed{[1,3] \cup [4,5]}", r"[1,3]\cup[4,5]", 1),
    (r"\boxed{(1,2]}", "[1,2)", 0),
    (r"\boxed{[0, 1)}", "[0,1]", 0),
    # sets
    (r"\boxed{\{3,2,1\}}", r"\{1,2,3\}", 1),
    (r"\boxed{2, 1}", "1,2", 1),
    (r"\boxed{\{-1, 1\}}", r"\pm 1", 1),
    (r"\boxed{\{1,2,3\}}", r"\{1,2\}", 0),
    (r"\boxed{\{1,3\}}", r"\{1,2\}", 0),
    (r"\boxed{(4,3)}", "(3,4)", 0),
    # percentages (math-verify accepts a percentage and its number either way)
    (r"\boxed{0.5}", r"50\%", 1),
    (r"\boxed{\frac14}", r"25\%", 1),
    (r"\boxed{12.5\%}", "0.125", 1),
    (r"\boxed{50}", r"50\%", 1),
    (r"\boxed{0.6}", r"50\%", 0),
    # nested braces
    (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{\sqrt{2}}{2}", 1),
    (r"\boxed{\left\{1, \frac{1}{2}\right\}}", r"\{\frac12, 1\}", 1),
    (r"\boxed{2^{2^{2}}}", "16", 1),
    (r"\boxed{\frac{\frac{1}{2}}{\frac{1}{4}}}", "2", 1),
    # \fbox and several boxes: the last one counts
    (r"\fbox{42}", "42", 1),
    (r"\fbox{41}", "42", 0),
    (r"first \boxed{1}, finally \fbox{2}", "2", 1),
    (r"\boxed{3} wait, \boxed{4}", "4", 1),
    (r"\boxed{4} no, \boxed{3}", "4", 0),
    (r"\boxed 7", "7", 1),
    (r"so $\boxed{7}$.", "7", 1),
    (r"\boxed{-3}", "3", 0),
    (r"\boxed{1176470588235295}", "1176470588235294", 0),
    # no box, or nothing that parses: the format penalty
    ("The answer is 5", "5", P),
    ("", "5", P),
    (r"\boxed{1", "1", P),
    (r"\boxed{ }", "1", P),
    (r"\boxed{4} and \boxed{}", "4", P),
    (r"\boxed{\frac{}{}}", "1", P),
    (r"\boxed{?}", "1", P),
    # prose ground truths are compared as text, not as products of letters
    (r"\boxed{\text{No}}", "No", 1),
    (r"\boxed{\text{no integer solutions.}}", "No integer solutions", 1),
    (r"\boxed{Yes}", "No", 0),
    (r"\boxed{On}", "No", 0),
]


def test_table_is_large_and_balanced() -> None:
    assert len(PAIRS) >= 60
    assert sum(1 for *_, want in PAIRS if want == 1) >= 30
    assert sum(1 for *_, want in PAIRS if want == 0) >= 15


@pytest.mark.parametrize(("response", "truth", "want"), PAIRS)
def test_pair(response: str, truth: str, want: float) -> None:
    assert score(response, truth) == want


def test_format_penalty_is_configurable() -> None:
    assert score("no box here", "1", format_penalty=-0.5) == -0.5
    assert score("no box here", "1", format_penalty=0.0) == 0.0


@pytest.mark.parametrize(
    ("text", "want"),
    [
        (r"\boxed{1}", "1"),
        (r"\boxed{\frac{a}{b^{2}}}", r"\frac{a}{b^{2}}"),
        (r"\boxed{1} then \boxed{2}", "2"),
        (r"\fbox{1} then \boxed{2} then \fbox{3}", "3"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
        (r"\boxed{\}}", r"\}"),
        (r"\boxed 5.", "5"),
        (r"\boxed{1} \boxed{2", None),
        (r"\boxedfoo{1}", None),
        ("no box", None),
        ("\\boxed", None),
    ],
)
def test_last_boxed(text: str, want: str | None) -> None:
    assert last_boxed(text) == want


PATHOLOGICAL = [
    "9^{9^{9^{9}}}",
    "10^{10^{10^{10}}}",
    "(x+1)^{100000}",
    "2^{2^{2^{2^{2^{2}}}}}",
    "((((((((((x+1)^2)^2)^2)^2)^2)^2)^2)^2)^2)^2",
    "999999999!",
    "(" * 400 + "1" + ")" * 400,
]
LIMIT_S = 1.0
SLACK_S = 1.5  # process scheduling on a loaded 2-core machine


@pytest.fixture
def warm_pool() -> None:
    warm_up()  # start workers (and replace any killed one) outside the timed region


@pytest.mark.parametrize("expr", PATHOLOGICAL)
def test_pathological_input_times_out_to_zero(warm_pool: None, expr: str) -> None:
    start = time.monotonic()
    assert score(f"\\boxed{{{expr}}}", "1", timeout_s=LIMIT_S) == 0.0
    assert time.monotonic() - start < LIMIT_S + GRACE_S + SLACK_S


def test_time_limit_holds_in_threads(warm_pool: None) -> None:
    """Four threads at once (math-verify's own signal-based timeout would fail here)."""
    results: dict[int, tuple[float, float]] = {}

    def run(i: int) -> None:
        start = time.monotonic()
        expr = PATHOLOGICAL[i] if i % 2 == 0 else r"\frac{1}{2}"
        results[i] = (score(f"\\boxed{{{expr}}}", "0.5", timeout_s=LIMIT_S),
                      time.monotonic() - start)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i][0] for i in range(4)] == [0.0, 1.0, 0.0, 1.0]
    # two pool slots on two cores: at most two deadlines back to back, plus worker restarts
    assert time.monotonic() - start < 2 * (LIMIT_S + GRACE_S) + 2 * SLACK_S + 10


def test_time_limit_holds_in_asyncio(warm_pool: None) -> None:
    async def main() -> list[float]:
        async with loop_ticks(0.05) as ticks:
            scores = await asyncio.gather(
                score_async(rf"\boxed{{{PATHOLOGICAL[0]}}}", "1", timeout_s=LIMIT_S),
                score_async(r"\boxed{3}", "3.0"),
            )
        assert ticks.count >= 5, "the event loop was blocked while scoring"
        return list(scores)

    start = time.monotonic()
    assert asyncio.run(main()) == [0.0, 1.0]
    assert time.monotonic() - start < LIMIT_S + GRACE_S + SLACK_S + 5


STUCK_WORKER = '''
import json, signal, sys, time
signal.signal(signal.SIGALRM, signal.SIG_IGN)
sys.stdout.write('{"ready": true}\\n'); sys.stdout.flush()
for line in sys.stdin:
    request = json.loads(line)
    if request["pred"] == "hang":
        while True:  # ignores every signal but SIGKILL, like a C-level bignum loop
            time.sleep(0.01)
    sys.stdout.write(json.dumps({"verdict": "correct"}) + "\\n"); sys.stdout.flush()
'''


def test_pool_kills_a_worker_that_ignores_the_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "stuck_worker.py").write_text(STUCK_WORKER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    pool = VerifierPool(1, module="stuck_worker")
    try:
        assert pool.call({"gold": "1", "pred": "1"}, 1.0) == {"verdict": "correct"}
        (first,) = pool._all
        start = time.monotonic()
        assert pool.call({"gold": "1", "pred": "hang"}, 0.5) is None
        assert time.monotonic() - start < 0.5 + GRACE_S + SLACK_S
        assert first.proc.poll() is not None, "the stuck worker was not killed"
        assert pool.call({"gold": "1", "pred": "1"}, 1.0) == {"verdict": "correct"}
        assert first not in pool._all
    finally:
        pool.close()



def test_warm_up_starts_every_worker_once() -> None:
    pool = VerifierPool(2)
    try:
        pool.warm()
        workers = set(pool._all)
        assert len(workers) == 2
        pool.warm()
        assert pool._all == workers
        assert pool.call({"gold": "1/2", "pred": "0.5"}, 5.0) == {"verdict": "correct"}
    finally:
        pool.close()
    assert all(w.proc.poll() is not None for w in workers), "close() left a worker running"


def fake_verifiers(
    monkeypatch: pytest.MonkeyPatch, verdict_of: Callable[[str], str | None]
) -> list[str]:
    """Verifier workers that answer `verdict_of(pred)` (None: a timeout), with nothing
    remembered yet; returns the list of what they are asked."""
    asked: list[str] = []

    class Pool:
        def call(self, request: dict[str, object], timeout_s: float) -> dict[str, object] | None:
            asked.append(str(request["pred"]))
            verdict = verdict_of(str(request["pred"]))
            return None if verdict is None else {"verdict": verdict}

    monkeypatch.setattr(math_reward, "get_pool", Pool)
    monkeypatch.setattr(math_reward, "_verdicts", {})
    return asked


def test_a_settled_verdict_is_asked_once_a_timeout_every_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked = fake_verifiers(monkeypatch, lambda pred: None if pred == "slow" else "wrong")
    assert [math_reward.check("41.5", "42") for _ in range(3)] == ["wrong"] * 3
    assert [math_reward.check("slow", "42") for _ in range(2)] == ["timeout"] * 2
    assert math_reward.check("41.5", "42", timeout_s=1.0) == "wrong"  # another limit: asked anew
    assert asked == ["41.5", "slow", "slow", "41.5"]


def test_remembered_only_scores_exact_and_remembered_answers_and_asks_no_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked = fake_verifiers(monkeypatch, lambda pred: "correct" if pred == "42.0" else "wrong")
    quick = functools.partial(math_reward.score, remembered_only=True)
    assert quick("so \\boxed{42}", "42") == 1.0  # exact: no comparison at all
    assert quick("no box here", "42") == math_reward.FORMAT_PENALTY
    with pytest.raises(math_reward.Unsettled):
        quick("\\boxed{42.0}", "42")
    with pytest.raises(math_reward.Unsettled):
        math_reward.any_format_correct("it is 41.5", "42", remembered_only=True)
    assert quick("so \\boxed{+042}", "42") == 1.0  # two integers: no worker either
    assert quick("so \\boxed{41}", "42") == 0.0
    assert math_reward.any_format_correct("it is 41", "42", remembered_only=True) is False
    assert asked == []
    assert math_reward.score("\\boxed{42.0}", "42") == 1.0  # asks, and remembers
    assert math_reward.any_format_correct("it is 41.5", "42") is False
    assert quick("\\boxed{42.0}", "42") == 1.0
    assert math_reward.any_format_correct("it is 41.5", "42", remembered_only=True) is False
    assert asked == ["42.0", "41.5"]


INTEGER_PAIRS = [
    ("7", "7"), ("007", "7"), ("+5", "5"), ("-0", "0"), ("0", "-0"), ("12", "13"),
    ("-5", "5"), ("066", "66"), (" 42 ", "42"), ("10", "010"), ("-12", "-012"),
    ("1000000000000000000001", "1000000000000000000000"),
]
"""(answer, ground truth) pairs of two integer literals: compared without a worker."""
NOT_INTEGER_PAIRS = [
    ("99999999999999999999", "1e20"), ("4", "4.0"), ("1,000", "1000"), ("٣", "3"),
    ("5", "5%"), ("1" * 1001, "1"),
]
"""Pairs with a side that is no plain integer literal: left to the worker."""


@pytest.mark.parametrize(("pred", "gold"), INTEGER_PAIRS)
def test_integer_verdicts_are_math_verifys(pred: str, gold: str) -> None:
    from marl.rewards.verifier_worker import judge

    assert math_reward.integer_verdict(pred, gold) == judge(gold.strip(), pred.strip())


@pytest.mark.parametrize(("pred", "gold"), NOT_INTEGER_PAIRS)
def test_anything_but_two_integers_is_left_to_the_worker(pred: str, gold: str) -> None:
    assert math_reward.integer_verdict(pred, gold) is None


@pytest.mark.parametrize(
    ("boxed", "gold", "question", "reward"),
    [
        # the problem's own expression restated: math-verify alone calls each one equal
        ("23+29", "52", "What is 23+29?", 0.0),
        ("23 + 29", "52", "What is 23 + 29? Answer in \\boxed{}.", 0.0),
        ("29+23", "52", "What is 23+29?", 0.0),  # a sum with its operands swapped
        ("2^{10}", "1024", "Compute $2^{10}$.", 0.0),
        ("2^10", "1024", "Compute $2^{10}$.", 0.0),
        ("\\frac{8}{2}", "4", "Simplify 8/2.", 0.0),
        ("8 \\div 2", "4", "Simplify 8/2.", 0.0),
        ("3 \\times 7", "21", "What is $3 \\cdot 7$?", 0.0),
        # an equal value the problem does not write: correct however it is written
        ("2^10", "1024", "How many subsets has a set of 10 elements?", 1.0),
        ("2^{10}", "1024", "How many subsets has a set of 10 elements?", 1.0),
        ("2 \\cdot 512", "1024", "How many subsets has a set of 10 elements?", 1.0),
        ("32 \\times 32", "1024", "How many subsets has a set of 10 elements?", 1.0),
        ("8/2", "4", "Eight apples are shared by two children. How many each?", 1.0),
        ("\\frac{8}{2}", "4", "Eight apples are shared by two children. How many each?", 1.0),
        ("1.024 \\times 10^{3}", "1024", "How many subsets has a set of 10 elements?", 1.0),
        ("1.024e3", "1024", "How many subsets has a set of 10 elements?", 1.0),
        ("6.02\\times10^{23}", "602000000000000000000000", "Avogadro's number?", 1.0),
        ("1.2e-3", "0.0012", "What is 12 thousandths of a tenth?", 1.0),
        ("1.2 \\cdot 10^{-3}", "3/2500", "What is 12 thousandths of a tenth?", 1.0),
        ("6.03\\times10^{23}", "602000000000000000000000", "Avogadro's number?", 0.0),
        ("2^{10}", "1000", "How many subsets has a set of 10 elements?", 0.0),
        # a part of the problem's expression, or its digits in another order, is no restatement
        ("3+29", "32", "What is 23+29?", 1.0),
        ("2^5", "32", "What is 23+29?", 1.0),
        # a fraction in lowest terms is a value, even where the problem writes it
        ("\\frac{1}{2}", "0.5", "A coin lands heads with probability 1/2. P(tails)?", 1.0),
        ("1/2", "1/2", "A coin lands heads with probability 1/2. P(tails)?", 1.0),
        ("52", "52", "What is 23+29?", 1.0),
        ("-7", "-7", "What is 3-10?", 1.0),
        ("x+1", "x+1", "Simplify (x^2-1)/(x-1).", 1.0),
    ],
)
def test_an_equal_value_is_correct_unless_it_restates_the_question(
    boxed: str, gold: str, question: str, reward: float
) -> None:
    response = f"So \\boxed{{{boxed}}}."
    assert score(response, gold, question=question) == reward
    assert math_reward.any_format_correct(response, gold, question=question) is (reward == 1.0)


def test_without_the_question_an_expression_is_compared_by_value() -> None:
    assert score("\\boxed{23+29}", "52") == 1.0


@pytest.mark.parametrize(("text", "plain"), [
    ("1.024e3", "1024"), ("1.024 \\times 10^{3}", "1024"), ("-2.5E-2", "-0.025"),
    ("3*10^2", "300"), ("1e400", "1" + "0" * 400), ("1e401", None), ("2^{10}", None),
    ("12", None), ("e3", None),
])
def test_scientific_notation_is_written_out_exactly(text: str, plain: str | None) -> None:
    assert math_reward.plain_number(text) == plain


def test_the_builtin_reward_reads_the_problems_text_and_its_messages() -> None:
    from marl.problem import Problem
    from marl.rewards.builtin import math_reward as builtin_math

    class Task:
        format_penalty, math_timeout_s = -0.1, 5.0

    class Episode:
        task = Task()

    asked = Problem(id="p", prompt="What is 23+29?", answer="52")
    in_messages = Problem(id="q", prompt="", answer="52",
                          messages=[{"role": "user", "content": "Add: $23 + 29$"}])
    elsewhere = Problem(id="r", prompt="Add twenty-three and twenty-nine.", answer="52")
    got = [asyncio.run(builtin_math(p, "\\boxed{23+29}", Episode())) for p in
           (asked, in_messages, elsewhere)]
    assert got == [{"score": 0.0, "any_format_correct": 0.0},
                   {"score": 0.0, "any_format_correct": 0.0},
                   {"score": 1.0, "any_format_correct": 1.0}]
