"""A task and its answer, as a worker and the learner see them on the streams."""

from __future__ import annotations

from marl.problem import Problem
from marl.rollout import AdapterRef, Rollout, Task
from marl.spec.run import RunSpec


def a_task() -> Task:
    """run-1's task for problem p: sample 0 of step 0."""
    return Task.for_spec(
        RunSpec(), "run-1", Problem(id="p", prompt="q", answer="1"), 0, "train", 0,
        {"generator": AdapterRef("run-1/generator", 1)},
    )


def answered(task: Task) -> Rollout:
    """A worker's successful rollout of `task`, with no turns."""
    return Rollout(task.id, task.run_id, task.step, task.kind, task.problem.id, task.sample,
                   [], "x", 1.0, "w", 0.1)
