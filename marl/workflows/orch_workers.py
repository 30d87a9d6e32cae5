"""Orch-Workers: an orchestrator plans, three workers solve, a synthesizer answers.

The orchestrator writes a plan (slot 0); the workers (slots 0..n-1, one role:
one adapter under Isolated-Policy) each solve the problem from the problem and
the plan, concurrently; the synthesizer writes the final answer from every
worker's output.

Facts: `workers_oracle_pass_at_n` (some worker's output is correct) and, when
the workers have a majority (two or more agree), `synthesizer_agrees_with_majority`.
"""

from __future__ import annotations

import asyncio

from marl.problem import Problem
from marl.spec.run import WorkflowCaps
from marl.workflows import prompts
from marl.workflows.answers import answer_key, majority
from marl.workflows.base import PAPER_PROMPT_TOKENS, Caps, Episode, TaskName, Workflow, prompt_cap


def caps(spec: WorkflowCaps, task: TaskName) -> Caps:
    return Caps(
        prompt_tokens=prompt_cap(spec, task, PAPER_PROMPT_TOKENS), parallel=spec.orch_workers
    )


async def run(episode: Episode, problem: Problem) -> str:
    plan = await episode.turn("orchestrator", 0, prompts.orchestrator(problem))
    outputs = list(
        await asyncio.gather(
            *(
                episode.turn("worker", slot, prompts.worker(problem, plan))
                for slot in range(episode.caps.parallel)
            )
        )
    )
    final = await episode.turn("synthesizer", 0, prompts.synthesizer(problem, outputs))

    right = await asyncio.gather(*(episode.correct(o) for o in outputs))
    episode.facts["workers_oracle_pass_at_n"] = float(any(right))
    top, count = majority([answer_key(o, problem.task) for o in outputs])
    if count >= 2:
        episode.facts["synthesizer_agrees_with_majority"] = float(
            answer_key(final, problem.task) == top
        )
    return final


ORCH_WORKERS = Workflow(
    name="orch_workers", roles=("orchestrator", "worker", "synthesizer"), run=run, caps=caps
)
