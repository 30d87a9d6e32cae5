"""Test-only workflows that plant role drift, for tests/integration/test_drift_planted.py.

`LONG_AGGREGATOR` is Voting with a planted reward: the aggregator's answer counts only
when it is given in the generators' long-form idiom ("The answer is N") instead of the
terse `\\boxed{N}` stamp its prompt asks for. Under a shared adapter this rewards the
aggregator slot for taking the generators' shape, the Voting-SP aggregator capture of the
paper's §5.2 and Table 5 Panel A3, which `sp_role_capture` must catch from the
aggregator's terse rate. Not a workflow anyone should train.
"""

from __future__ import annotations

import re

from marl.data.problem import Problem
from marl.workflows import voting
from marl.workflows.base import Episode, Workflow

_LONG_FORM = re.compile(r"\s*The\s*answer\s*is\s*(-?\d+)\s*", re.IGNORECASE)


async def run(episode: Episode, problem: Problem) -> str:
    final = await voting.run(episode, problem)
    long_form = _LONG_FORM.fullmatch(final)
    # the scored answer: the long form's number, boxed; a terse stamp scores as no answer
    return f"\\boxed{{{long_form.group(1)}}}" if long_form else ""


LONG_AGGREGATOR = Workflow(
    name="long_aggregator", roles=("generator", "aggregator"), run=run, caps=voting.caps
)
