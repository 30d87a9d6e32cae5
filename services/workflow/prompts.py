"""What each role is told. Kept short: the demo's tiny model reads these too.

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


def _instruction(problem: Problem) -> str:
    return CODE_INSTRUCTION if problem.task == "code" else MATH_INSTRUCTION


def solver(problem: Problem) -> Messages:
    """The single agent and each Voting generator."""
    return [{"role": "user", "content": f"{problem.prompt}\n\n{_instruction(problem)}"}]


def aggregator(problem: Problem, candidates: list[str]) -> Messages:
    listed = "\n\n".join(f"Candidate {i + 1}:\n{c.strip()}" for i, c in enumerate(candidates))
    return [
        {
            "role": "user",
            "content": f"{problem.prompt}\n\n{listed}\n\n"
            f"{AGGREGATOR_INSTRUCTION}. {_instruction(problem)}",
        }
    ]


ALL_TEMPLATE_TEXT = " ".join(
    [MATH_INSTRUCTION, CODE_INSTRUCTION, AGGREGATOR_INSTRUCTION, "Candidate 1: 2: 3:"]
)
"""Every fixed word the roles can see; the demo tokenizer's vocabulary covers them."""
