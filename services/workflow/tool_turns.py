"""A role turn that may call tools: model call, tool calls, tool messages, model call, ...

The loop behind `episode.tool_turn` (marl/workflows/tools.py says what a tool is and
how calls are parsed and answered). Each model call is one recorded turn whose
prompt is the exchange so far, rendered with the tools (the chat template's own
tool format, or Hermes' in a system message); the calls it made and how many were
answered with an error are counted on it (`Turn.tool_calls`, `Turn.tool_errors`).
The loop ends when the model answers without a call, when it has made
`max_tool_calls` (its next answer is final whatever it holds), when a call is cut
by the token cap, or when the next prompt would pass the prompt cap or the
context (the last answer is then final: a long tool exchange is not a failed
episode).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from marl.workflows import tools as tools_

DEFAULT_MAX_TOOL_CALLS = 8
"""Tool calls one tool turn may make when the workflow sets no `max_tool_calls`."""


async def tool_turn(
    episode: Any,
    role: str,
    slot: int,
    messages: list[dict[str, Any]],
    tools: Sequence[tools_.Tool],
    max_tool_calls: int | None = None,
) -> str:
    from services.workflow.episode_runtime import PromptTooLong

    limit = DEFAULT_MAX_TOOL_CALLS if max_tool_calls is None else max_tool_calls
    if limit < 0:
        raise ValueError(f"max_tool_calls must be >= 0, got {limit}")
    by_name = {t.name: t for t in tools}
    schemas = [t.schema() for t in tools]
    episode.tool_roles.add(role)
    history = list(messages)
    made = 0
    turn = await episode.run_turn(role, slot, history, tools=schemas)
    while True:
        calls = tools_.parse_tool_calls(turn.text)
        if not calls or made >= limit or turn.finish_reason == "length":
            return str(turn.text)
        calls = calls[: limit - made]
        history.append(tools_.assistant_message(turn.text, calls))
        for call in calls:
            content, error = await tools_.execute(call, by_name, episode)
            history.append(tools_.tool_message(call.name or "invalid", content))
            turn.tool_calls += 1
            turn.tool_errors += int(error)
        made += len(calls)
        last = turn
        try:
            turn = await episode.run_turn(role, slot, history, tools=schemas)
        except PromptTooLong:
            return str(last.text)
