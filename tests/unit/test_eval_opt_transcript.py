"""Eval-Opt keeps its transcript: every evaluator and reviser turn sees the problem and every
earlier solution and critique, in order, within the prompt cap (oldest pairs cut first).

The runtime Episode renders with `CharTokenizer` (one token a character, no chat template:
a prompt is its content and "\\n\\n"), so every length below is counted by hand.
"""

from __future__ import annotations

import pytest

from marl.spec.run import WorkflowCaps
from services.workflow.episode_runtime import PromptTooLong
from tests.support.workflows_scripted import ScriptedEngine, make_task, run_episode

VERDICT = "Write a short critique, then give your verdict: \\boxed{Correct} or \\boxed{Incorrect}."


def always_incorrect() -> ScriptedEngine:
    """Generator slot k answers `answer \\boxed{k+3}`; the n-th critique says Incorrect."""
    critiques = 0

    def script(role: str, slot: int, prompt: str) -> str:
        nonlocal critiques
        if role == "generator":
            return f"answer \\boxed{{{slot + 3}}}"
        critiques += 1
        return f"critique {critiques}: \\boxed{{Incorrect}}"

    return ScriptedEngine(script)


# Solution k and critique k as shown again (73 characters with the blank line after).
PAIR1 = "Solution 1:\nanswer \\boxed{3}\n\nCritique 1:\ncritique 1: \\boxed{Incorrect}\n\n"
PAIR2 = "Solution 2:\nanswer \\boxed{4}\n\nCritique 2:\ncritique 2: \\boxed{Incorrect}\n\n"
PAIR3 = "Solution 3:\nanswer \\boxed{5}\n\nCritique 3:\ncritique 3: \\boxed{Incorrect}\n\n"
EVALUATOR_3 = f"Solution 3:\nanswer \\boxed{{5}}\n\nCheck solution 3. {VERDICT}\n\n"
REVISE_3 = "Revise your solution 3 with critique 3. Answer in \\boxed{}.\n\n"
PROBLEM = "What is 2 + 3?\n\n"


def yours(pair: str) -> str:
    """The pair as the reviser is shown it: its own solutions."""
    return "Your s" + pair[1:]


async def test_third_round_prompts_hold_both_earlier_solutions_and_critiques_in_order() -> None:
    engine = always_incorrect()
    _, final = await run_episode(make_task("eval_opt"), engine)
    roles = [(s.role, s.slot) for s in engine.seen]
    assert roles == [
        ("generator", 0),
        ("evaluator", 0),
        ("generator", 1),
        ("evaluator", 1),
        ("generator", 2),
        ("evaluator", 2),
        ("generator", 3),
    ]
    assert final == "answer \\boxed{6}"
    # round 3's evaluator: the problem, solution 1, critique 1, solution 2, critique 2, then
    # the solution it judges
    assert engine.seen[5].prompt == PROBLEM + PAIR1 + PAIR2 + EVALUATOR_3
    # the reviser after it: all three solutions and critiques, then the instruction
    assert engine.seen[6].prompt == (
        PROBLEM + yours(PAIR1) + yours(PAIR2) + yours(PAIR3) + REVISE_3
    )
    # round 2 already shows round 1's exchange
    assert engine.seen[3].prompt == (
        PROBLEM + PAIR1 + f"Solution 2:\nanswer \\boxed{{4}}\n\nCheck solution 2. {VERDICT}\n\n"
    )
    assert engine.seen[4].prompt == (
        PROBLEM
        + yours(PAIR1)
        + yours(PAIR2)
        + "Revise your solution 2 with critique 2. Answer in \\boxed{}.\n\n"
    )
    # round 1 reads as before: one solution, then one solution and its critique
    assert engine.seen[1].prompt.startswith(PROBLEM + "Solution:\nanswer \\boxed{3}\n\n")
    assert engine.seen[2].prompt.startswith(PROBLEM + "Your previous solution:\n")


async def test_the_cap_cuts_the_oldest_pair_first_and_keeps_the_latest() -> None:
    # Whole-transcript lengths (content + "\n\n"): evaluator 151, 224, 297; reviser 160, 233,
    # 311 (an earlier pair adds 73 to the evaluator's prompt, 78 with "Your " to the
    # reviser's). At a cap of 233 rounds 1-2 fit whole (round 2's reviser is exactly 233);
    # round 3's evaluator (297) and reviser (311) drop pair 1: 297 - 73 = 224 and
    # 311 - 78 = 233 (the reviser keeps pair 2 and the latest exchange, pair 3).
    engine = always_incorrect()
    task = make_task("eval_opt", caps=WorkflowCaps(prompt_tokens_math=233))
    _, final = await run_episode(task, engine)
    assert final == "answer \\boxed{6}"
    lengths = [len(s.prompt) for s in engine.seen]
    assert lengths == [37, 151, 160, 224, 233, 224, 233]
    assert engine.seen[4].prompt.count("Your solution") == 2  # round 2 whole at the cap
    assert engine.seen[5].prompt == PROBLEM + PAIR2 + EVALUATOR_3
    assert engine.seen[6].prompt == PROBLEM + yours(PAIR2) + yours(PAIR3) + REVISE_3


async def test_a_tight_cap_leaves_only_the_problem_and_the_latest_exchange() -> None:
    # 160: round 1 fits (151, 160); later rounds show only the latest solution (151) and
    # the latest solution with its critique (155), numbered by their round
    engine = always_incorrect()
    task = make_task("eval_opt", caps=WorkflowCaps(prompt_tokens_math=160))
    await run_episode(task, engine)
    assert [len(s.prompt) for s in engine.seen] == [37, 151, 160, 151, 155, 151, 155]
    assert engine.seen[5].prompt == PROBLEM + EVALUATOR_3
    assert engine.seen[6].prompt == PROBLEM + yours(PAIR3) + REVISE_3


async def test_a_cap_below_the_latest_exchange_fails_the_episode_as_before() -> None:
    engine = always_incorrect()
    task = make_task("eval_opt", caps=WorkflowCaps(prompt_tokens_math=150))
    with pytest.raises(PromptTooLong, match="evaluator prompt"):
        await run_episode(task, engine)
    assert [(s.role, s.slot) for s in engine.seen] == [("generator", 0)]
