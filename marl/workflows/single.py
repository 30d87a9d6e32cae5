"""Single: one generator answers alone (the paper's single-agent RL control).

Its prompt is the multi-agent generator's, and its role is called `generator`,
so its adapter can be placed on the generator role of Voting or Eval-Opt
(the paper's Table 3).
"""

from __future__ import annotations

from marl.problem import Problem
from marl.spec.run import WorkflowCaps
from marl.workflows import prompts
from marl.workflows.base import PAPER_PROMPT_TOKENS, Caps, Episode, TaskName, Workflow, prompt_cap


def caps(spec: WorkflowCaps, task: TaskName) -> Caps:
    return Caps(prompt_tokens=prompt_cap(spec, task, PAPER_PROMPT_TOKENS))


async def run(episode: Episode, problem: Problem) -> str:
    return await episode.turn("generator", 0, prompts.generator(problem))


SINGLE = Workflow(name="single", roles=("generator",), run=run, caps=caps)
