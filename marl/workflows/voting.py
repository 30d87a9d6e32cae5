"""Voting: three generators answer independently, an aggregator picks one of them.

The generators run concurrently (one role, slots 0..n-1: one adapter under
Isolated-Policy) on the same prompt; the aggregator sees every candidate, numbered
from 1, and is asked for a terse selection stamp: the chosen candidate's number as
`\\boxed{N}` (paper §A.4, §A.6.2).

The stamp as a candidate's *number* is marl's reading of the paper, which says both that
the aggregator "selects or combines among" the candidates (§3) and that it emits "a terse
`\\boxed{N}` selection stamp" (§A.4) without saying whether N is an index or the
answer. `workflow_args: {aggregator_output: answer}` takes the other reading: the
aggregator is asked for the final answer (`prompts.aggregator`) and its own text is
scored, so it may combine the candidates; `index` (the default) is the stamp below.

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
from typing import Literal

from pydantic import BaseModel, ConfigDict

from marl.problem import Problem
from marl.rewards.math_scoring import last_boxed
from marl.spec.run import WorkflowCaps
from marl.workflows import prompts
from marl.workflows.answers import answer_key, majority
from marl.workflows.base import PAPER_PROMPT_TOKENS, Caps, Episode, TaskName, Workflow, prompt_cap


class VotingArgs(BaseModel):
    """`workflow_args` of Voting."""

    model_config = ConfigDict(extra="forbid")
    aggregator_output: Literal["index", "answer"] = "index"
    """`index`: the aggregator stamps the chosen candidate's number, `\\boxed{N}`, and
    that candidate's text is the final answer; `answer`: the aggregator writes the final
    answer itself from the candidates (it may combine them) and its text is scored."""


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
    by_answer = episode.args is not None and episode.args.aggregator_output == "answer"
    if by_answer:
        final = await episode.turn("aggregator", 0, prompts.aggregator(problem, candidates))
    else:
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


VOTING = Workflow(name="voting", roles=("generator", "aggregator"), run=run, caps=caps,
                  args=VotingArgs)
