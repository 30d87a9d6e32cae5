"""An open-ended task scored by an LLM judge: a writer answers, the judge grades it.

The writer gets the data's prompt as it is (its chat messages when the file gave
messages), with no answer-format instruction: nothing here is checked by a rule.
The reward is the judge's (`reward.judge` in the spec; marl/rewards/llm_judge.py):

    workflow: examples.workflows.judged:WRITER
    reward:
      judge: {model: base, max_score: 10}

The judge is the run's frozen base model on its own inference replicas, so its
turns are recorded in each rollout (`judge_turns`) and not trained; naming the
judge role in `policy_groups` would train it too.
"""

from __future__ import annotations

from marl.problem import Problem
from marl.workflows import Episode, Workflow


async def write(episode: Episode, problem: Problem) -> str:
    messages = [dict(m) for m in problem.messages] if problem.messages else [
        {"role": "user", "content": problem.prompt}]
    return await episode.turn("writer", 0, messages)


WRITER = Workflow(name="writer", roles=("writer",), run=write)
