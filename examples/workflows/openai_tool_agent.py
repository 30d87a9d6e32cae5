"""An agent with tools written only against the OpenAI client, trained by marl as it is.

`solve` is ordinary tool-calling agent code: it offers a `calculator` function,
runs the calls the model makes, sends the results back as `tool` messages, and
stops when the model answers. marl hands it a client whose base URL is the
episode's recording endpoint: every chat call is the `solver` role's turn
(token ids, sampling log-probs, adapter version recorded), the tool results are
prompt tokens of the next call (never trained on), and GRPO trains the solver
from the final answer's reward.

    workflow: examples.workflows.openai_tool_agent:AGENT
"""

from __future__ import annotations

import json
from typing import Any

from openai import AsyncOpenAI

from marl.problem import Problem
from marl.workflows import Episode, Workflow
from marl.workflows.tools import calculate

TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]
MAX_CALLS = 3


def run_tool(name: str, arguments: str) -> str:
    try:
        args = json.loads(arguments)
        if name != "calculator":
            return f"error: unknown tool {name}"
        return calculate(str(args["expression"]))
    except Exception as err:  # the agent reports a failed call to the model, as agents do
        return f"error: {err}"


async def solve(client: AsyncOpenAI, question: str) -> str:
    messages: list[Any] = [{"role": "user", "content": f"{question}\n\nAnswer in \\boxed{{}}."}]
    for _ in range(MAX_CALLS + 1):
        reply = await client.chat.completions.create(model="solver", messages=messages,
                                                     tools=TOOLS)
        message = reply.choices[0].message
        if not message.tool_calls:
            return message.content or ""
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            fn = call.function  # type: ignore[union-attr]
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": run_tool(fn.name, fn.arguments)})
    return ""


async def run(episode: Episode, problem: Problem) -> str:
    async with AsyncOpenAI(base_url=await episode.openai_base_url(), api_key="episode",
                           max_retries=0) as client:
        return await solve(client, problem.prompt)


AGENT = Workflow(name="openai_tool_agent", roles=("solver",), run=run)
