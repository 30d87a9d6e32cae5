"""Trajectory signatures on hand-made transcripts, against numbers counted by hand."""

from __future__ import annotations

import pytest

from marl.diagnostics import signatures as sg
from marl.rollout import AdapterRef, Rollout, Turn

REF = AdapterRef("r/shared", 1)


def turn(
    role: str, text: str, n_tokens: int, slot: int = 0, finish: str = "stop", tok: int | None = None
) -> Turn:
    """`tok`: every completion token is this id (default 0, 1, 2, ...)."""
    ids = list(range(n_tokens)) if tok is None else [tok] * n_tokens
    return Turn(role, slot, [1, 2], ids, [0.0] * n_tokens, finish, REF, text)


def said(role: str, words: str, slot: int) -> Turn:
    """A turn whose completion tokens are its words' letters (a, b, c -> 97, 98, 99)."""
    ids = [ord(w) for w in words.split()]
    return Turn(role, slot, [1], ids, [0.0] * len(ids), "stop", REF, words)


def rollout(problem: str, turns: list[Turn], sample: int = 0, error: str | None = None) -> Rollout:
    return Rollout(
        f"t{problem}{sample}", "r", 3, "val", problem, sample, turns, "", 0.0, error=error
    )


def test_lengths_mean_and_nearest_rank_percentiles() -> None:
    turns = [turn("g", "x", n) for n in (10, 40, 20, 30)]
    s = sg.lengths(turns)
    assert (s.mean, s.p50, s.p95) == (25.0, 30.0, 40.0)
    twenty = [turn("g", "x", n) for n in range(1, 21)]
    assert sg.lengths(twenty).p95 == 20.0
    assert sg.lengths(twenty).p50 == 11.0
    assert sg.length_gap(twenty) == 9.0


def test_truncation_and_boxed_retention() -> None:
    turns = [
        turn("g", "so \\boxed{4}", 5),
        turn("g", "cut off \\boxed{4", 9, finish="length"),
        turn("g", "no box at all", 9, finish="length"),
        turn("g", "\\boxed{x+1} done", 5),
    ]
    assert sg.truncation_rate(turns) == 0.5
    assert sg.boxed_rate(turns) == 0.5


def test_hedging_phrases_whole_words_any_case() -> None:
    texts = [
        "Wait, that is off.",  # wait
        "Let me   reconsider the sum.",  # let me reconsider, spread over spaces
        "The awaiting room.",  # no: 'wait' inside a word
        "This is WRONG.",  # this is wrong
        "Hmmm not a phrase.",  # no: hmmm is not hmm
        "it is not correct",  # not correct
        "plain answer \\boxed{2}",
        "actually fine",
    ]
    turns = [turn("g", t, 3) for t in texts]
    assert [sg.hedges(t) for t in texts] == [True, True, False, True, False, True, False, True]
    assert sg.hedging_rate(turns) == 5 / 8


def test_inter_slot_jaccard_within_episode_then_problem_then_across() -> None:
    # token 3-grams; p1 sample 0: slots "a b c d" {abc, bcd} and "a b c e" {abc, bce}: 1/3
    # p1 sample 1: identical slots: 1.0 -> p1 = (1/3 + 1) / 2 = 2/3
    # p2: three slots: "x y z" {xyz}, "x y z" {xyz}, "q r s" {qrs}: pairs 1, 0, 0 -> 1/3
    # across problems: (2/3 + 1/3) / 2 = 0.5
    rs = [
        rollout(
            "p1",
            [
                said("generator", "a b c d", 0),
                said("generator", "a b c e", 1),
                turn("aggregator", "a b c d", 4),
            ],
        ),
        rollout("p1", [said("generator", "u v w", 0), said("generator", "u v w", 1)], 1),
        rollout(
            "p2",
            [
                said("generator", "x y z", 0),
                said("generator", "x y z", 1),
                said("generator", "q r s", 2),
            ],
        ),
        rollout("p3", [said("generator", "o n e", 0)]),
    ]
    assert sg.inter_slot_jaccard(rs, "generator") == pytest.approx(0.5)
    assert sg.inter_slot_jaccard(rs, "aggregator") is None


def test_jaccard_uses_the_first_turn_of_each_slot() -> None:
    turns = [said("w", "a b c", 0), said("w", "a b c", 1), said("w", "z z z", 1)]
    assert sg.episode_jaccard(turns) == 1.0


def test_aggregator_terse_rate() -> None:
    turns = [
        turn("aggregator", "\\boxed{7}", 30),  # terse: 30 tokens with a box
        turn("aggregator", "\\boxed{7}", 31),  # too long
        turn("aggregator", "seven", 3),  # no box
        turn("aggregator", "I pick \\boxed{3}", 12),  # terse
    ]
    assert sg.terse_rate(turns) == 0.5


def test_evaluator_output_class_and_verdict_parse_rate() -> None:
    code3 = "Fixed:\n```python\ndef f(x):\n\n    y = x\n    return y\n```\n\\boxed{Incorrect}"
    code2 = "```python\nx = 1\nprint(x)\n```\n\\boxed{Correct}"
    turns = [
        turn("evaluator", code3, 50),  # python fence, 3 non-blank body lines
        turn("evaluator", code2, 20),  # fence of 2 lines: not code, not a bare stamp
        turn("evaluator", "Looks right. \\boxed{Correct}", 200),  # bare stamp at 200
        turn("evaluator", "Looks right. \\boxed{Correct}", 201),  # too long for a stamp
        turn("evaluator", "```py\na\nb\nc", 30),  # unclosed py fence (truncated) counts
        turn("evaluator", "I think it is fine", 5),  # no verdict
    ]
    assert [sg.evaluator_class(t) for t in turns] == [
        "python_code_fence",
        "other",
        "bare_stamp",
        "other",
        "python_code_fence",
        "other",
    ]
    assert sg.evaluator_classes(turns) == {
        "python_code_fence": 2 / 6,
        "bare_stamp": 1 / 6,
        "other": 3 / 6,
    }
    assert sg.verdict_parse_rate(turns) == 4 / 6


def test_orchestrator_distinct_openers() -> None:
    texts = [
        "Split the problem into parts",
        "split  THE problem: differently",
        "First, compute x",
        "Go",
    ]
    assert sg.distinct_openers([turn("orchestrator", t, 5) for t in texts]) == 3


def test_role_signatures_names_every_role_and_skips_failed_episodes() -> None:
    rs = [
        rollout(
            "p1",
            [
                turn("worker", "a b c", 10, 0, tok=1),
                turn("worker", "a b c", 30, 1, tok=1),
                turn("orchestrator", "Plan: do it", 4),
                turn("synthesizer", "\\boxed{1}", 6),
            ],
        ),
        rollout(
            "p2",
            [
                turn("worker", "d e f", 20, 0, tok=2),
                turn("worker", "g h i wait", 40, 1, "length", tok=3),
                turn("orchestrator", "Plan: do it", 4),
                turn("synthesizer", "answer 2", 100),
            ],
        ),
        rollout("p3", [turn("worker", "ignored", 999)], error="no replica"),
    ]
    sig = sg.role_signatures(rs, "orch_workers")
    assert sig["sig/worker/len_mean"] == 25.0
    assert sig["sig/worker/len_p50"] == 30.0
    assert sig["sig/worker/len_p95"] == 40.0
    assert sig["sig/worker/len_gap"] == 10.0
    assert sig["sig/worker/truncation_rate"] == 0.25
    assert sig["sig/worker/hedging_rate"] == 0.25
    assert sig["sig/worker/jaccard3"] == 0.5  # p1: 1.0, p2: 0.0
    assert sig["sig/orchestrator/distinct_openers"] == 1.0
    assert sig["sig/synthesizer/len_gap"] == 0.0  # [6, 100]: p50 and p95 both rank 1
    assert sig["sig/synthesizer/len_p50"] == 100.0
    assert sig["sig/synthesizer/boxed_rate"] == 0.5
    assert "sig/orchestrator/jaccard3" not in sig
    # Eval-Opt's generator slots are revisions, not parallel: no Jaccard there
    ev = sg.role_signatures(
        [rollout("p", [said("generator", "a b c", 0), said("generator", "a b c", 1)])],
        "eval_opt",
    )
    assert "sig/generator/jaccard3" not in ev
