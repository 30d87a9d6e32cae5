"""Test-only workflows that plant role drift, for tests/integration/test_drift_planted.py.

`LONG_AGGREGATOR` is Voting with a planted reward: the aggregator's answer counts only
when it is given in the generators' long-form idiom ("The answer is N") instead of the
terse `\\boxed{N}` stamp its prompt asks for. Under a shared adapter this rewards the
aggregator slot for taking the generators' shape, the Voting-SP aggregator capture of the
paper's §5.2 and Table 5 Panel A3, which `sp_role_capture` must catch from the
aggregator's terse rate. Not a workflow anyone should train.

The aggregator keeps the prompt the shipped demo model was warm-started on
(`prompts.aggregator`: "give the final answer", which it answers with the boxed sum),
not Voting's selection-stamp prompt, and its own text is what gets scored: the planted
pressure is on the aggregator's shape alone, whatever candidate a stamp would pick.
"""

from __future__ import annotations

import asyncio
import re

from marl.problem import Problem
from marl.workflows import prompts, voting
from marl.workflows.base import Episode, Workflow

_LONG_FORM = re.compile(r"\s*The\s*answer\s*is\s*(-?\d+)\s*", re.IGNORECASE)


async def run(episode: Episode, problem: Problem) -> str:
    n = episode.caps.parallel
    candidates = await asyncio.gather(
        *(episode.turn("generator", slot, prompts.generator(problem)) for slot in range(n))
    )
    final = await episode.turn("aggregator", 0, prompts.aggregator(problem, list(candidates)))
    long_form = _LONG_FORM.fullmatch(final)
    # the scored answer: the long form's number, boxed; a terse stamp scores as no answer
    return f"\\boxed{{{long_form.group(1)}}}" if long_form else ""


LONG_AGGREGATOR = Workflow(
    name="long_aggregator", roles=("generator", "aggregator"), run=run, caps=voting.caps
)
