"""Voting: three generators answer independently, an aggregator gives the final answer.

The generators run concurrently (one role, slots 0..n-1: one adapter under
Isolated-Policy) on the same prompt; the aggregator sees every candidate.

Facts: `majority_agreement` (share of the candidates that give the most common
answer), `oracle_pass_at_n` (some candidate is correct), and, when a majority
exists (two or more agree), `aggregator_picked_majority`.
"""

from __future__ import annotations

import asyncio

from marl.config import WorkflowCaps
from marl.data.problem import Problem
from marl.workflows import prompts
from marl.workflows.answers import answer_key, majority
from marl.workflows.base import PAPER_PROMPT_TOKENS, Caps, Episode, TaskName, Workflow, prompt_cap


def caps(spec: WorkflowCaps, task: TaskName) -> Caps:
    return Caps(
        prompt_tokens=prompt_cap(spec, task, PAPER_PROMPT_TOKENS), parallel=spec.voting_candidates
    )


async def run(episode: Episode, problem: Problem) -> str:
    n = episode.caps.parallel
    candidates = list(
        await asyncio.gather(
            *(episode.turn("generator", slot, prompts.generator(problem)) for slot in range(n))
        )
    )
    final = await episode.turn("aggregator", 0, prompts.aggregator(problem, candidates))

    keys = [answer_key(c, problem.task) for c in candidates]
    top, count = majority(keys)
    episode.facts["majority_agreement"] = count / n
    right = await asyncio.gather(*(episode.correct(c) for c in candidates))
    episode.facts["oracle_pass_at_n"] = float(any(right))
    if count >= 2:
        episode.facts["aggregator_picked_majority"] = float(
            answer_key(final, problem.task) == top
        )
    return final


VOTING = Workflow(name="voting", roles=("generator", "aggregator"), run=run, caps=caps)
