"""Debate: two solvers answer, each revises after reading the other, a judge decides.

A user workflow, written only against marl's small workflow API and trained by
naming it in a run spec, with no change to marl:

    workflow: examples.workflows.debate:DEBATE

(from the repository root, or anywhere `examples` is importable by the learner
and the workers). Under `policy: isolated` the solvers share one adapter and
the judge has its own; `policy_groups` may map both roles to one.
"""

from __future__ import annotations

import asyncio

from marl.problem import Problem
from marl.workflows import Episode, Workflow, prompts


def rebuttal(problem: Problem, mine: str, theirs: str) -> prompts.Messages:
    return prompts.user(
        f"{problem.prompt}\n\nYour previous solution:\n{mine.strip()}\n\n"
        f"Another solution:\n{theirs.strip()}\n\n"
        f"Check both, then give your final answer. {prompts.instruction(problem)}"
    )


async def run(episode: Episode, problem: Problem) -> str:
    first = await asyncio.gather(
        *(episode.turn("solver", slot, prompts.generator(problem)) for slot in (0, 1))
    )
    rounds = episode.caps.extra["debate_rounds"]
    for _ in range(rounds):
        first = await asyncio.gather(
            *(
                episode.turn("solver", slot, rebuttal(problem, first[slot], first[1 - slot]))
                for slot in (0, 1)
            )
        )
    return await episode.turn("judge", 0, prompts.aggregator(problem, list(first)))


DEBATE = Workflow(name="debate", roles=("solver", "judge"), run=run, caps={"debate_rounds": 1})
