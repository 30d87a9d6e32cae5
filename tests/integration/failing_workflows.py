"""Test-only workflows whose episodes fail on purpose, for tests/integration/test_run_outcome.py.

`EVERY_OTHER_STEP` is Single, except that on every other training step (the 2nd, 4th, ...)
every sample but the first of each group fails as an episode that could not be played
(an `EpisodeError`, as a sandbox outage or a missing replica would): those steps lose
(group_size - 1) / group_size of their episodes. Validation episodes never fail.
"""

from __future__ import annotations

from typing import Any

from marl.problem import Problem
from marl.workflows import single
from marl.workflows.base import EpisodeError, Workflow


async def run(episode: Any, problem: Problem) -> str:
    task = episode.task  # the worker's Episode; the Episode protocol does not promise it
    if task.kind == "train" and task.step % 2 == 1 and task.sample > 0:
        raise EpisodeError(f"planted failure (step {task.step}, sample {task.sample})")
    return await single.run(episode, problem)


EVERY_OTHER_STEP = Workflow(
    name="every_other_step", roles=("generator",), run=run, caps=single.caps
)
