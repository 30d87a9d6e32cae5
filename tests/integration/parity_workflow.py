"""A test-only workflow whose code reward varies with what the model samples, for
tests/integration/test_sandbox_lost_mid_step.py and test_load.py.

A tiny model never writes a passing program, so every code reward would be 0 and
every advantage 0: leaving failed rollouts out would change nothing a test could
see. `PARITY` turns the generator's reply into a program that prints its length
mod 2; the problems' one test expects "0". The sandbox runs that program for real,
and the rewards of a group differ as the sampled replies do. `MOSTLY_RIGHT` prints
0 unless the length is a multiple of 4: about 3 of 4 replies score 1, so a few
rollouts of a group are rarely all 0.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from marl.problem import Problem
from marl.workflows import single
from marl.workflows.base import Episode, Workflow


def _scored_by_length(name: str, program: Callable[[int], str]) -> Workflow:
    """A Single workflow whose final answer is `program(len(reply))` as a Python block."""

    async def run(episode: Episode, problem: Problem) -> str:
        reply = await single.run(episode, problem)
        return f"```python\n{program(len(reply))}\n```"

    return Workflow(name=name, roles=("generator",), run=run, caps=single.caps)


PARITY = _scored_by_length("parity", lambda n: f"print({n} % 2)")
MOSTLY_RIGHT = _scored_by_length("mostly_right", lambda n: f"print(int({n} % 4 == 0))")

PARITY_REF = "tests.integration.parity_workflow:PARITY"
"""How a run spec names it (`workflow:`)."""
MOSTLY_RIGHT_REF = "tests.integration.parity_workflow:MOSTLY_RIGHT"


def write_problems(path: Path, n: int = 40) -> Path:
    rows = [
        {
            "problem": f"Problem {i}: print 0.",
            "tests": json.dumps([{"type": "stdin_stdout", "input": "", "output": "0\n"}]),
            "starter_code": "",
            "metadata": "{}",
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
