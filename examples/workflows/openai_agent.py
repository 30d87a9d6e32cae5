"""A two-role agent written only against the OpenAI client, trained by marl as it is.

`solve` is ordinary agent code: it knows nothing of marl, only of an
`openai.AsyncOpenAI` client and two model names. A drafter answers, a checker
reads the draft and gives the final answer. To train it, the workflow hands it
a client whose base URL is the episode's recording endpoint: the model names
are the workflow's roles, every call is served by that role's adapter version
and recorded as that role's turn (token ids, sampling log-probs, version), and
marl's GRPO trains both roles from the one reward of the final answer.

Train it by naming it in a run spec:

    workflow: examples.workflows.openai_agent:AGENT

(from the repository root, or anywhere `examples` is importable by the
workers). Inside an episode the run's sampling settings apply; what the agent
passes as `temperature` or `max_tokens` is ignored.
"""

from __future__ import annotations

from openai import AsyncOpenAI

from marl.problem import Problem
from marl.workflows import Episode, Workflow


async def solve(client: AsyncOpenAI, question: str) -> str:
    draft = await client.chat.completions.create(
        model="drafter",
        messages=[{"role": "user", "content": question}],
        temperature=0.7,
    )
    answer = draft.choices[0].message.content or ""
    final = await client.chat.completions.create(
        model="checker",
        messages=[
            {"role": "system", "content": "Check the proposed answer. Put the final answer "
                                          "in \\boxed{}."},
            {"role": "user", "content": f"{question}\n\nProposed answer: {answer}"},
        ],
    )
    return final.choices[0].message.content or ""


async def run(episode: Episode, problem: Problem) -> str:
    async with AsyncOpenAI(base_url=await episode.openai_base_url(), api_key="episode",
                           max_retries=0) as client:
        return await solve(client, problem.prompt)


AGENT = Workflow(name="openai_agent", roles=("drafter", "checker"), run=run)
