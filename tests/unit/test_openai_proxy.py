"""The episode's OpenAI endpoint, driven by the real `openai.AsyncOpenAI` over loopback HTTP.

The episode here is a stand-in whose `turn` records what a real episode
records (the integration test `test_openai_agent.py` runs the real one):
the proxy must map each call to `turn(role, slot, messages)` and answer with
that turn's text, tokens and log-probs.
"""

from __future__ import annotations

import asyncio
import gc
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest

from marl.rollout import AdapterRef, Turn
from marl.workflows import EpisodeError
from services.workflow import openai_proxy


class CharTokenizer:
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids)


@dataclass
class Task:
    adapters: dict[str, AdapterRef]


@dataclass
class StandInEpisode:
    task: Task
    tokenizer: Any = field(default_factory=CharTokenizer)
    turns: list[Turn] = field(default_factory=list)
    calls: list[tuple[str, int, list[dict[str, str]]]] = field(default_factory=list)

    async def turn(self, role: str, slot: int, messages: list[dict[str, str]]) -> str:
        return (await self.run_turn(role, slot, messages)).text

    async def run_turn(self, role: str, slot: int, messages: list[dict[str, str]],
                       tools: list[dict[str, Any]] | None = None) -> Turn:
        self.calls.append((role, slot, messages))
        if messages[-1]["content"] == "too long":
            raise EpisodeError("the drafter prompt is over the prompt cap")
        await asyncio.sleep(0.01 * (3 - slot))  # parallel calls finish out of order
        text = f"{role}{slot}"
        if tools:  # the model calls the first tool offered, then answers with its result
            if messages[-1]["role"] == "tool":
                text = f"the result is {messages[-1]['content']}. STOP and more"
            else:
                name = tools[0]["function"]["name"]
                text = f'<tool_call>{{"name": "{name}", "arguments": {{"x": 2}}}}</tool_call>'

        ref = self.task.adapters[role]
        record = Turn(role=role, slot=slot, prompt_ids=[1, 2, slot],
                      completion_ids=[ord(c) for c in text], logprobs=[-0.5] * len(text),
                      finish_reason="stop", adapter=ref, text=text)
        self.turns.append(record)
        return record


def episode() -> StandInEpisode:
    return StandInEpisode(Task({"drafter": AdapterRef("run/drafter", 3),
                                "checker": AdapterRef("run/checker", 3)}))


async def test_calls_become_role_turns() -> None:
    ep = episode()
    url = await openai_proxy.base_url(ep)
    async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0) as client:
        messages: Any = [{"role": "user", "content": "2+2?"}]
        first = await client.chat.completions.create(model="drafter", messages=messages,
                                                     temperature=0.3, logprobs=True,
                                                     extra_body={"return_token_ids": True})
        assert first.choices[0].message.content == "drafter0"
        assert first.choices[0].finish_reason == "stop"
        assert first.choices[0].logprobs is not None
        assert [t.logprob for t in first.choices[0].logprobs.content or []] == [-0.5] * 8
        assert (first.model_extra or {})["prompt_token_ids"] == [1, 2, 0]
        assert first.usage is not None and first.usage.completion_tokens == 8
        # parallel slots of one role: each answer is its own call's turn
        answers = await asyncio.gather(*(
            client.chat.completions.create(model=f"checker:{slot}", messages=messages)
            for slot in range(3)))
        assert [a.choices[0].message.content for a in answers] == [
            "checker0", "checker1", "checker2"]
        models = [m.id async for m in client.models.list()]
        assert models == ["drafter", "checker"]
    assert ep.calls[0] == ("drafter", 0, [{"role": "user", "content": "2+2?"}])
    assert sorted((r, s) for r, s, _ in ep.calls) == [
        ("checker", 0), ("checker", 1), ("checker", 2), ("drafter", 0)]


@pytest.mark.parametrize("args, error, text", [
    ({"model": "judge"}, openai.NotFoundError, "not a role of this episode"),
    ({"model": "drafter:x"}, openai.BadRequestError, "slot"),
    ({"model": "drafter", "n": 2}, openai.BadRequestError, "n:"),
    ({"model": "drafter", "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": "required"}, openai.BadRequestError, "tool_choice:"),
])
async def test_refusals(args: dict[str, Any], error: type[Exception], text: str) -> None:
    ep = episode()
    url = await openai_proxy.base_url(ep)
    async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0) as client:
        with pytest.raises(error, match=text):
            await client.chat.completions.create(
                messages=[{"role": "user", "content": "hi"}], **args)
    assert ep.calls == [] and ep.turns == []


async def test_an_ended_episode_is_gone() -> None:
    ep = episode()
    url = await openai_proxy.base_url(ep)
    assert await openai_proxy.base_url(ep) == url
    del ep
    gc.collect()
    async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0) as client:
        with pytest.raises(openai.NotFoundError, match="no such episode"):
            await client.chat.completions.create(
                model="drafter", messages=[{"role": "user", "content": "hi"}])


async def test_a_turn_that_cannot_run_fails_the_episode() -> None:
    """The agent sees a 503 it does not retry; the worker re-raises the turn's own error."""
    ep = episode()
    url = await openai_proxy.base_url(ep)
    async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=2) as client:
        with pytest.raises(openai.InternalServerError, match="prompt cap"):
            await client.chat.completions.create(
                model="drafter", messages=[{"role": "user", "content": "too long"}])
        ok = await client.chat.completions.create(
            model="checker", messages=[{"role": "user", "content": "fine"}])
        assert ok.choices[0].message.content == "checker0"
    assert len(ep.calls) == 2  # not retried
    with pytest.raises(EpisodeError, match="prompt cap"):
        openai_proxy.raise_failure(ep)
    openai_proxy.raise_failure(episode())  # an episode without failures: nothing raised


async def test_tools_come_back_as_tool_calls_and_stop_is_honoured() -> None:
    ep = episode()
    url = await openai_proxy.base_url(ep)
    tools = [{"type": "function", "function": {"name": "double", "description": "x * 2",
                                               "parameters": {"type": "object"}}}]
    async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0) as client:
        messages: list[Any] = [{"role": "user", "content": "double 2"}]
        first = await client.chat.completions.create(model="drafter", messages=messages,
                                                     tools=tools)  # type: ignore[arg-type]
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls"
        (called,) = choice.message.tool_calls or []
        assert called.function.name == "double"  # type: ignore[union-attr]
        assert called.function.arguments == '{"x": 2}'  # type: ignore[union-attr]
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": called.id, "content": "4"}]
        second = await client.chat.completions.create(model="drafter", messages=messages,
                                                      tools=tools, stop=["STOP"])  # type: ignore[arg-type]
    assert second.choices[0].message.content == "the result is 4. "
    assert second.choices[0].finish_reason == "stop"
    # the recorded turn ends with the token that completed the stop string
    assert ep.turns[1].text == "the result is 4. "
    assert "".join(map(chr, ep.turns[1].completion_ids)) == "the result is 4. STOP"
    assert len(ep.turns[1].logprobs) == len(ep.turns[1].completion_ids)
    assert ep.calls[1][2][1]["tool_calls"][0]["function"] == {"name": "double",
                                                              "arguments": {"x": 2}}
