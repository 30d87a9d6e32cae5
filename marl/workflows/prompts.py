"""What each role is told, per task (math, code). Kept short: the demo's tiny model reads
these too, and its word-level tokenizer knows these words (`marl.demo_model.EXTRA_WORDS`);
a word it does not know (`SELECT_INSTRUCTION`'s "only", "number") reads as `<unk>`.

Every builder returns chat messages; the worker renders them with the model's
chat template. The answer format (`\\boxed{}`, or one fenced Python block) is said
here, once, for every data set of its task; loaders' prompts do not repeat it. Parts
are separated by blank lines so that a fence closing the problem's (or a candidate's)
code stays on a line of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from marl.problem import Problem

Messages = list[dict[str, str]]

MATH_INSTRUCTION = "Answer in \\boxed{}."
CODE_INSTRUCTION = "Answer with a complete Python solution in one fenced ```python block."
AGGREGATOR_INSTRUCTION = "Pick the best candidate and give the final answer"
SELECT_INSTRUCTION = (
    "Pick the best candidate. Reply with only its number in \\boxed{}, "
    "as \\boxed{1} for Candidate 1."
)
"""Voting's aggregator: a terse `\\boxed{N}` selection stamp (paper §A.4, §A.6.2)."""
VERDICT_INSTRUCTION = (
    "Write a short critique, then give your verdict: \\boxed{Correct} or \\boxed{Incorrect}."
)
EVALUATOR_INSTRUCTION = f"Check the solution. {VERDICT_INSTRUCTION}"
REVISE_INSTRUCTION = "Revise your solution with the critique."
ORCHESTRATOR_INSTRUCTION = "Write a short plan for the workers. Do not solve the problem."
WORKER_INSTRUCTION = "Solve the problem with the plan."
SYNTHESIZER_INSTRUCTION = "Combine the workers outputs and give the final answer"


def instruction(problem: Problem) -> str:
    """The task's answer format: `\\boxed{}` for math, one fenced Python block for code."""
    return CODE_INSTRUCTION if problem.task == "code" else MATH_INSTRUCTION


def user(content: str) -> Messages:
    """One user message: the shape of every prompt here."""
    return [{"role": "user", "content": content}]


def listed(label: str, texts: list[str]) -> str:
    """`Label 1:\\n...` blocks separated by blank lines (candidates, workers' outputs)."""
    return "\n\n".join(f"{label} {i + 1}:\n{t.strip()}" for i, t in enumerate(texts))


def generator(problem: Problem) -> Messages:
    """The single agent, each Voting generator and Eval-Opt's first answer (the same
    prompt, so a single-agent adapter can serve the multi-agent generator role)."""
    return [{"role": "user", "content": f"{problem.prompt}\n\n{instruction(problem)}"}]


def aggregator(problem: Problem, candidates: list[str]) -> Messages:
    """The final answer written from the candidates (a user workflow's judge; the demo
    model's warm start). Voting's aggregator is asked for a stamp instead (`selector`)."""
    shown = listed("Candidate", candidates)
    return [
        {
            "role": "user",
            "content": f"{problem.prompt}\n\n{shown}\n\n"
            f"{AGGREGATOR_INSTRUCTION}. {instruction(problem)}",
        }
    ]


def selector(problem: Problem, candidates: list[str]) -> Messages:
    """Voting: the aggregator picks a candidate and answers with its number, `\\boxed{N}`."""
    return user(f"{problem.prompt}\n\n{listed('Candidate', candidates)}\n\n{SELECT_INSTRUCTION}")


Exchange = tuple[int, str, str]
"""One earlier Eval-Opt round as shown again: (its number from 1, the solution, its critique)."""


def _exchanges(solution_label: str, earlier: Sequence[Exchange]) -> list[str]:
    return [
        f"{solution_label} {n}:\n{solution.strip()}\n\nCritique {n}:\n{critique.strip()}"
        for n, solution, critique in earlier
    ]


def evaluator(
    problem: Problem, solution: str, earlier: Sequence[Exchange] = (), number: int = 1
) -> Messages:
    """Eval-Opt: judge the generator's latest solution (`number`, counted from 1), after
    the `earlier` solutions and critiques of the episode, oldest first; verdict in
    `\\boxed{}`. The first evaluation (no earlier round) reads as a lone solution."""
    if number == 1 and not earlier:
        return user(f"{problem.prompt}\n\nSolution:\n{solution.strip()}\n\n{EVALUATOR_INSTRUCTION}")
    parts = [
        problem.prompt,
        *_exchanges("Solution", earlier),
        f"Solution {number}:\n{solution.strip()}",
        f"Check solution {number}. {VERDICT_INSTRUCTION}",
    ]
    return user("\n\n".join(parts))


def reviser(
    problem: Problem,
    solution: str,
    critique: str,
    earlier: Sequence[Exchange] = (),
    number: int = 1,
) -> Messages:
    """Eval-Opt: the generator revises its latest solution (`number`, counted from 1) after
    an Incorrect verdict, seeing the `earlier` solutions and critiques too, oldest first.
    The first revision (no earlier round) reads as one previous solution and its critique."""
    if number == 1 and not earlier:
        return user(
            f"{problem.prompt}\n\nYour previous solution:\n{solution.strip()}\n\n"
            f"Critique:\n{critique.strip()}\n\n{REVISE_INSTRUCTION} {instruction(problem)}"
        )
    parts = [
        problem.prompt,
        *_exchanges("Your solution", [*earlier, (number, solution, critique)]),
        f"Revise your solution {number} with critique {number}. {instruction(problem)}",
    ]
    return user("\n\n".join(parts))


def orchestrator(problem: Problem) -> Messages:
    """Orch-Workers: a plan for the workers, not a solution."""
    return user(f"{problem.prompt}\n\n{ORCHESTRATOR_INSTRUCTION}")


def worker(problem: Problem, plan: str) -> Messages:
    """Orch-Workers: each worker solves the problem following the orchestrator's plan."""
    return user(
        f"{problem.prompt}\n\nPlan:\n{plan.strip()}\n\n{WORKER_INSTRUCTION} {instruction(problem)}"
    )


def synthesizer(problem: Problem, outputs: list[str]) -> Messages:
    """Orch-Workers: the final answer from every worker's output."""
    return user(
        f"{problem.prompt}\n\n{listed('Worker', outputs)}\n\n"
        f"{SYNTHESIZER_INSTRUCTION}. {instruction(problem)}"
    )


ALL_TEMPLATE_TEXT = " ".join(
    [MATH_INSTRUCTION, CODE_INSTRUCTION, AGGREGATOR_INSTRUCTION, SELECT_INSTRUCTION,
     "Candidate 1: 2: 3:"]
)
"""The fixed words of the single-agent and Voting prompts, which the demo tokenizer was built
from (with `EXTRA_WORDS`); changing it changes the shipped demo model's vocabulary."""
