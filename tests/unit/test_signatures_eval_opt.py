"""Eval-Opt's signatures as Tables 4-6 read them: every turn, the first round (`iter1/`),
the later rounds (`later/`), and the evaluator's verdict rates; numbers counted by hand."""

from __future__ import annotations

import pytest

from marl.diagnostics import signatures as sg
from marl.rollout import AdapterRef, Rollout, Turn

REF = AdapterRef("r/shared", 1)
FENCE = "```"


def turn(role: str, slot: int, text: str, n_tokens: int, finish: str = "stop") -> Turn:
    return Turn(role, slot, [1, 2], list(range(n_tokens)), [0.0] * n_tokens, finish, REF, text)


def rollout(problem: str, turns: list[Turn], error: str | None = None) -> Rollout:
    return Rollout(f"t{problem}", "r", 3, "val", problem, 0, turns, "", 0.0, error=error)


# Generator slot 0 is the first answer, slot k the k-th revision; evaluator slot 0 judges
# the first answer, slot k the k-th revision.
ROLLOUTS = [
    rollout(  # Incorrect, revised, then Correct
        "p1",
        [
            turn("generator", 0, "first \\boxed{3}", 10),
            turn("evaluator", 0, "Wrong. \\boxed{Incorrect}", 20),  # bare stamp
            turn("generator", 1, "wait, \\boxed{5}", 30),  # hedges
            turn("evaluator", 1, "Fine. \\boxed{Correct}", 40),  # bare stamp
        ],
    ),
    rollout(  # the evaluator writes code, then says Correct: no revision
        "p2",
        [
            turn("generator", 0, "\\boxed{5}", 50),
            turn("evaluator", 0, f"{FENCE}python\na\nb\nc\n{FENCE}\n\\boxed{{Correct}}", 300),
        ],
    ),
    rollout(  # no verdict parses: two revisions, the cap
        "p3",
        [
            turn("generator", 0, "no box", 70, "length"),
            turn("evaluator", 0, "hmm, not sure", 60),  # hedges, unparseable
            turn("generator", 1, "\\boxed{4}", 80),
            turn("evaluator", 1, "\\boxed{maybe}", 90),  # unparseable
            turn("generator", 2, "\\boxed{6}", 100),
        ],
    ),
    rollout("p4", [turn("evaluator", 0, "\\boxed{Correct}", 5)], error="no replica"),
]


def test_generator_first_answer_apart_from_its_revisions() -> None:
    sig = sg.role_signatures(ROLLOUTS, "eval_opt")
    # iter1: lengths [10, 50, 70] (nearest rank: p50 index 1, p95 index 2)
    assert sig["sig/generator/iter1/len_mean"] == pytest.approx(130 / 3)
    assert sig["sig/generator/iter1/len_p50"] == 50.0
    assert sig["sig/generator/iter1/len_p95"] == 70.0
    assert sig["sig/generator/iter1/len_gap"] == 20.0
    assert sig["sig/generator/iter1/truncation_rate"] == pytest.approx(1 / 3)
    assert sig["sig/generator/iter1/boxed_rate"] == pytest.approx(2 / 3)
    assert sig["sig/generator/iter1/hedging_rate"] == 0.0
    # later: [30, 80, 100]
    assert sig["sig/generator/later/len_mean"] == 70.0
    assert sig["sig/generator/later/len_p50"] == 80.0
    assert sig["sig/generator/later/len_p95"] == 100.0
    assert sig["sig/generator/later/truncation_rate"] == 0.0
    assert sig["sig/generator/later/boxed_rate"] == 1.0
    assert sig["sig/generator/later/hedging_rate"] == pytest.approx(1 / 3)
    # every turn, as before: [10, 30, 50, 70, 80, 100]
    assert sig["sig/generator/len_mean"] == pytest.approx(340 / 6)
    assert sig["sig/generator/len_p50"] == 70.0
    assert sig["sig/generator/len_p95"] == 100.0
    assert sig["sig/generator/truncation_rate"] == pytest.approx(1 / 6)
    assert sig["sig/generator/boxed_rate"] == pytest.approx(5 / 6)
    assert "sig/generator/jaccard3" not in sig  # revisions are not parallel slots


def test_evaluator_first_evaluation_apart_and_its_verdict_rates() -> None:
    sig = sg.role_signatures(ROLLOUTS, "eval_opt")
    # iter1: Incorrect stamp (20), code + Correct (300), hmm no verdict (60)
    assert sig["sig/evaluator/iter1/bare_stamp"] == pytest.approx(1 / 3)
    assert sig["sig/evaluator/iter1/python_code_fence"] == pytest.approx(1 / 3)
    assert sig["sig/evaluator/iter1/other"] == pytest.approx(1 / 3)
    assert sig["sig/evaluator/iter1/boxed_correct_rate"] == pytest.approx(1 / 3)
    assert sig["sig/evaluator/iter1/unparseable_rate"] == pytest.approx(1 / 3)
    assert sig["sig/evaluator/iter1/verdict_parse_rate"] == pytest.approx(2 / 3)
    assert sig["sig/evaluator/iter1/hedging_rate"] == pytest.approx(1 / 3)
    assert sig["sig/evaluator/iter1/len_p50"] == 60.0
    assert sig["sig/evaluator/iter1/len_p95"] == 300.0
    assert sig["sig/evaluator/iter1/len_gap"] == 240.0
    # later: Correct stamp (40), \boxed{maybe} (90)
    assert sig["sig/evaluator/later/bare_stamp"] == 0.5
    assert sig["sig/evaluator/later/other"] == 0.5
    assert sig["sig/evaluator/later/python_code_fence"] == 0.0
    assert sig["sig/evaluator/later/boxed_correct_rate"] == 0.5
    assert sig["sig/evaluator/later/unparseable_rate"] == 0.5
    assert sig["sig/evaluator/later/len_mean"] == 65.0
    assert sig["sig/evaluator/later/len_p50"] == 90.0
    # every evaluation (the failed episode's is left out): Correct 2 of 5, no verdict 2 of 5
    assert sig["sig/evaluator/boxed_correct_rate"] == pytest.approx(2 / 5)
    assert sig["sig/evaluator/unparseable_rate"] == pytest.approx(2 / 5)
    assert sig["sig/evaluator/verdict_parse_rate"] == pytest.approx(3 / 5)
    assert sig["sig/evaluator/bare_stamp"] == pytest.approx(2 / 5)
    assert sig["sig/evaluator/len_mean"] == pytest.approx(510 / 5)


def test_each_round_part_has_the_same_names_as_the_whole() -> None:
    sig = sg.role_signatures(ROLLOUTS, "eval_opt")
    for role in ("generator", "evaluator"):
        whole = {
            k.rsplit("/", 1)[1] for k in sig if k.count("/") == 2 and k.startswith(f"sig/{role}/")
        }
        for part in ("iter1", "later"):
            names = {k.rsplit("/", 1)[1] for k in sig if k.startswith(f"sig/{role}/{part}/")}
            assert names == whole
    assert {k.rsplit("/", 1)[1] for k in sig if k.startswith("sig/evaluator/iter1/")} == {
        "len_mean", "len_p50", "len_p95", "len_gap", "truncation_rate", "boxed_rate",
        "hedging_rate", "python_code_fence", "bare_stamp", "other", "verdict_parse_rate",
        "boxed_correct_rate", "unparseable_rate",
    }  # fmt: skip


def test_no_later_names_when_every_first_answer_stood() -> None:
    sig = sg.role_signatures([ROLLOUTS[1]], "eval_opt")
    assert sig["sig/generator/iter1/len_mean"] == sig["sig/generator/len_mean"] == 50.0
    assert sig["sig/evaluator/iter1/boxed_correct_rate"] == 1.0
    assert not [k for k in sig if "/later/" in k]


def test_other_workflows_keep_one_name_per_signature() -> None:
    voting = [
        rollout(
            "p",
            [
                turn("generator", 0, "\\boxed{1}", 5),
                turn("generator", 1, "\\boxed{1}", 5),
                turn("aggregator", 0, "\\boxed{2}", 3),
            ],
        )
    ]
    sig = sg.role_signatures(voting, "voting")
    assert not [k for k in sig if "/iter1/" in k or "/later/" in k]
    # an evaluator in a user workflow still gets its verdict rates, over every turn
    user = sg.role_signatures(
        [rollout("p", [turn("evaluator", 0, "\\boxed{Correct}", 3)])], "mod:WORKFLOW"
    )
    assert user["sig/evaluator/boxed_correct_rate"] == 1.0
    assert user["sig/evaluator/unparseable_rate"] == 0.0
    assert not [k for k in user if "/iter1/" in k]
