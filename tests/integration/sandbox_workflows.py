"""A test-only workflow whose every answer holds a Python block, so that each episode of a
code problem runs its tests in the reward sandbox (tests/integration/test_sandbox_token.py):
a tiny model's few sampled tokens never make one.

`CODE_ANSWER` is Single (its generator's turn is what the step trains) whose final answer
is a fixed fenced block that compiles; its tests then fail or pass in the sandbox.
"""

from __future__ import annotations

from typing import Any

from marl.problem import Problem
from marl.workflows import single
from marl.workflows.base import Workflow

ANSWER = "```python\ndef solution(*args):\n    return None\n```"


async def run(episode: Any, problem: Problem) -> str:
    await single.run(episode, problem)
    return ANSWER


CODE_ANSWER = Workflow(name="code_answer", roles=("generator",), run=run, caps=single.caps)
