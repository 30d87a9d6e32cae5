"""Tool-using agents: a math solver with the `python` tool, and a code agent that runs
its own tests before answering. Each is one role whose turn may call tools
(`episode.tool_turn`); its arguments come from the run spec's `workflow_args`:

    workflow: examples.workflows.tool_agents:MATH_AGENT
    workflow_args: {tools: [python, calculator], max_tool_calls: 4}

A tool call is parsed in the chat template's format (Qwen3/Hermes `<tool_call>`),
runs (the `python` tool in the reward sandbox), and its result comes back as a tool
message; tool outputs are never trained on (marl/workflows/tools.py). docs/byo.md
walks through both.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from marl.problem import Problem
from marl.workflows import Episode, Workflow, prompts
from marl.workflows.tools import BUILTIN_TOOLS

ToolName = Literal["python", "calculator"]


class AgentArgs(BaseModel):
    """`workflow_args` of the tool agents."""

    model_config = ConfigDict(extra="forbid")
    tools: list[ToolName] = Field(default_factory=lambda: ["python"])
    """Built-in tools the solver may call."""
    max_tool_calls: int = Field(4, ge=0, le=64)
    """Tool calls per episode at most; the answer after the last one is final."""
    hint: str = "Use the tools to check your work."
    """Said after the problem; empty: nothing."""


def _messages(problem: Problem, hint: str) -> prompts.Messages:
    messages = [dict(m) for m in problem.messages] if problem.messages else (
        prompts.generator(problem))
    if hint:
        messages[-1]["content"] = f"{messages[-1]['content']}\n\n{hint}"
    return messages


async def solve(episode: Episode, problem: Problem) -> str:
    args: AgentArgs = episode.args
    tools = [BUILTIN_TOOLS[name] for name in args.tools]
    return await episode.tool_turn("solver", 0, _messages(problem, args.hint), tools,
                                   max_tool_calls=args.max_tool_calls)


MATH_AGENT = Workflow(name="math_agent", roles=("solver",), run=solve, args=AgentArgs)
"""A math solver that may compute with Python (or a calculator) before it answers in
`\\boxed{}`; scored by the math reward."""


class CodeAgentArgs(AgentArgs):
    hint: str = ("Before you answer, test your solution: run it with the python tool on "
                 "inputs of your own, then give the final solution in one ```python block.")


CODE_AGENT = Workflow(name="code_agent", roles=("solver",), run=solve, args=CodeAgentArgs)
"""A coder that runs its own tests with the `python` tool (in the sandbox) before it
answers; scored by the code reward on the problem's hidden tests."""
