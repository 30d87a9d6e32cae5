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
from pathlib import Path

from marl.data.problem import Problem
from marl.workflows import single
from marl.workflows.base import Episode, Workflow


async def run(episode: Episode, problem: Problem) -> str:
    reply = await single.run(episode, problem)
    return f"```python\nprint({len(reply)} % 2)\n```"


async def run_mostly_right(episode: Episode, problem: Problem) -> str:
    reply = await single.run(episode, problem)
    return f"```python\nprint(int({len(reply)} % 4 == 0))\n```"


PARITY = Workflow(name="parity", roles=("generator",), run=run, caps=single.caps)
MOSTLY_RIGHT = Workflow(
    name="mostly_right", roles=("generator",), run=run_mostly_right, caps=single.caps
)

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
