"""What each role is told, per task (math, code). Kept short: the demo's tiny model reads
these too, and its word-level tokenizer knows these words (`marl.demo_model.EXTRA_WORDS`).

Every builder returns chat messages; the worker renders them with the model's
chat template. The answer format (`\\boxed{}`, or one fenced Python block) is said
here, once, for every data set of its task; loaders' prompts do not repeat it. Parts
are separated by blank lines so that a fence closing the problem's (or a candidate's)
code stays on a line of its own.
"""

from __future__ import annotations

from marl.data.problem import Problem

Messages = list[dict[str, str]]

MATH_INSTRUCTION = "Answer in \\boxed{}."
CODE_INSTRUCTION = "Answer with a complete Python solution in one fenced ```python block."
AGGREGATOR_INSTRUCTION = "Pick the best candidate and give the final answer"
EVALUATOR_INSTRUCTION = (
    "Check the solution. Write a short critique, then give your verdict: "
    "\\boxed{Correct} or \\boxed{Incorrect}."
)
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
    shown = listed("Candidate", candidates)
    return [
        {
            "role": "user",
            "content": f"{problem.prompt}\n\n{shown}\n\n"
            f"{AGGREGATOR_INSTRUCTION}. {instruction(problem)}",
        }
    ]


def evaluator(problem: Problem, solution: str) -> Messages:
    """Eval-Opt: judge the generator's latest solution; verdict in `\\boxed{}`."""
    return user(f"{problem.prompt}\n\nSolution:\n{solution.strip()}\n\n{EVALUATOR_INSTRUCTION}")


def reviser(problem: Problem, solution: str, critique: str) -> Messages:
    """Eval-Opt: the generator revises its previous solution after an Incorrect verdict."""
    return user(
        f"{problem.prompt}\n\nYour previous solution:\n{solution.strip()}\n\n"
        f"Critique:\n{critique.strip()}\n\n{REVISE_INSTRUCTION} {instruction(problem)}"
    )


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
    [MATH_INSTRUCTION, CODE_INSTRUCTION, AGGREGATOR_INSTRUCTION, "Candidate 1: 2: 3:"]
)
"""The fixed words of the single-agent and Voting prompts, which the demo tokenizer was built
from (with `EXTRA_WORDS`); changing it changes the shipped demo model's vocabulary."""
