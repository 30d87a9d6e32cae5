"""Voting: three generators answer independently, an aggregator picks one of them.

The generators run concurrently (one role, slots 0..n-1: one adapter under
Isolated-Policy) on the same prompt; the aggregator sees every candidate, numbered
from 1, and is asked for a terse selection stamp: the chosen candidate's number as
`\\boxed{N}` (paper §A.4, §A.6.2).

The final answer: when the aggregator's last `\\boxed{}` holds a whole number N with
1 <= N <= n, candidate N's whole text (its own last `\\boxed{}` or code block is what
the reward reads); otherwise the aggregator's own text, as before the stamp was asked
for (an aggregator that writes the answer itself, `\\boxed{42}` among three
candidates, is scored on it). A math aggregator answering `\\boxed{2}` meaning "2"
among three candidates is read as picking candidate 2: the prompt asked for a number.

Facts: `majority_agreement` (share of the candidates that give the most common
answer), `oracle_pass_at_n` (some candidate is correct), and, when a majority
exists (two or more agree), `aggregator_picked_majority` (read on the final answer).
"""

from __future__ import annotations

import asyncio

from marl.data.problem import Problem
from marl.rewards.math import last_boxed
from marl.spec.run import WorkflowCaps
from marl.workflows import prompts
from marl.workflows.answers import answer_key, majority
from marl.workflows.base import PAPER_PROMPT_TOKENS, Caps, Episode, TaskName, Workflow, prompt_cap


def caps(spec: WorkflowCaps, task: TaskName) -> Caps:
    return Caps(
        prompt_tokens=prompt_cap(spec, task, PAPER_PROMPT_TOKENS), parallel=spec.voting_candidates
    )


def stamp(text: str, n: int) -> int | None:
    """The candidate (0-based) the aggregator's last `\\boxed{N}` picks, N from 1 to n;
    None when the last boxed is not such a number, or there is none."""
    boxed = last_boxed(text)
    picked = None if boxed is None else boxed.strip()
    if picked is None or not picked.isascii() or not picked.isdigit():
        return None
    index = int(picked) - 1
    return index if 0 <= index < n else None


async def run(episode: Episode, problem: Problem) -> str:
    n = episode.caps.parallel
    candidates = list(
        await asyncio.gather(
            *(episode.turn("generator", slot, prompts.generator(problem)) for slot in range(n))
        )
    )
    said = await episode.turn("aggregator", 0, prompts.selector(problem, candidates))
    picked = stamp(said, n)
    final = said if picked is None else candidates[picked]

    keys = [answer_key(c, problem.task) for c in candidates]
    top, count = majority(keys)
    episode.facts["majority_agreement"] = count / n
    right = await asyncio.gather(*(episode.correct(c) for c in candidates))
    episode.facts["oracle_pass_at_n"] = float(any(right))
    if count >= 2:
        episode.facts["aggregator_picked_majority"] = float(answer_key(final, problem.task) == top)
    return final


VOTING = Workflow(name="voting", roles=("generator", "aggregator"), run=run, caps=caps)
