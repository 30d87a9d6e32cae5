"""OpenAI request checks name the field; stop strings cut text and tokens consistently."""

from __future__ import annotations

from typing import Any

import pytest

from marl.protocol import openai as oa


class CharTokenizer:
    """One token per character (id = code point); enough to test stop-string cutting."""

    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == 0))


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "hi", **fields}


@pytest.mark.parametrize("fields, param", [
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"),
    ({"n": True}, "n"),
    ({"seed": "7"}, "seed"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": 3}, "stop"),
    ({"logprobs": 2}, "logprobs"),
    ({"stream": True}, "stream"),
    ({"echo": True}, "echo"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"best_of": 3}, "best_of"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"model": ""}, "model"),
    ({"mystery": 1}, "mystery"),
])
def test_bad_completion_parameter_names_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(oa.OpenAIError) as err:
        oa.parse_completion(completion(**fields))
    assert err.value.status == 400
    assert err.value.param == param
    assert err.value.message.startswith(f"{param}:")
    assert err.value.body()["error"]["param"] == param


def test_completion_defaults_and_prompt_forms() -> None:
    req = oa.parse_completion(completion(user="someone", logprobs=0, stop="\n"))
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.n, s.seed, s.stop, s.logprobs) == (
        16, 1.0, 1.0, 1, None, ["\n"], True)
    assert oa.parse_completion(completion(prompt=[5, 6])).prompts == [[5, 6]]
    assert oa.parse_completion(completion(prompt=["a", [5]])).prompts == ["a", [5]]


@pytest.mark.parametrize("fields, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": {"name": "f"}}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"logprobs": 1}, "logprobs"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
])
def test_bad_chat_parameter_names_the_field(fields: dict[str, Any], param: str) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    with pytest.raises(oa.OpenAIError) as err:
        oa.parse_chat(body)
    assert err.value.param == param


def test_chat_text_parts_are_joined() -> None:
    req = oa.parse_chat({"model": "m", "max_completion_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]})
    assert req.messages == [{"role": "user", "content": "ab"}]
    assert req.sampling.max_tokens == 5


def test_render_chat_without_template_joins_contents() -> None:
    ids = oa.render_chat(CharTokenizer(), [{"role": "user", "content": "ab"}])
    assert CharTokenizer().decode(ids) == "ab\n\n"


def test_stop_string_cuts_text_before_it_and_tokens_after_it() -> None:
    tok = CharTokenizer()
    ids = tok.encode("abc.def.")
    got = oa.finish(tok, ids, [-1.0] * len(ids), "length", [".", "zz"])
    assert got.text == "abc"
    assert got.token_ids == tok.encode("abc.")
    assert got.logprobs == [-1.0] * 4
    assert got.finish_reason == "stop"
    # a multi-token stop completes on its last token
    got = oa.finish(tok, ids, [0.0] * len(ids), "length", ["c.d"])
    assert (got.text, tok.decode(got.token_ids)) == ("ab", "abc.d")
    # no stop string in the text: unchanged, the EOS (id 0) dropped from the text only
    got = oa.finish(tok, [*tok.encode("ab"), 0], [0.0] * 3, "stop", ["x"])
    assert (got.text, got.token_ids, got.finish_reason) == ("ab", [97, 98, 0], "stop")


def test_single_token_stops_become_engine_stop_ids() -> None:
    assert oa.single_token_stops(CharTokenizer(), [".", "ab"]) == [ord(".")]


def test_bodies_follow_the_openai_shapes() -> None:
    tok = CharTokenizer()
    sampling = oa.Sampling(max_tokens=4, n=2, logprobs=True, return_token_ids=True)
    gens = [oa.Generated("ab", [97, 98], [-0.5, -0.25], "length"),
            oa.Generated("c", [99], [-1.0], "stop")]
    body = oa.completion_body("m", gens, [[1, 2, 3]], sampling, tok)
    assert body["object"] == "text_completion"
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["logprobs"] == {"tokens": ["a", "b"], "token_logprobs": [-0.5, -0.25],
                                              "top_logprobs": None, "text_offset": [0, 1]}
    assert body["choices"][1]["prompt_token_ids"] == [1, 2, 3]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    chat = oa.chat_body("m", gens[:1], [1, 2], oa.Sampling(max_tokens=4, logprobs=True), tok)
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "ab"}
    assert chat["choices"][0]["logprobs"]["content"][1] == {
        "token": "b", "logprob": -0.25, "bytes": [98], "top_logprobs": []}
    assert "prompt_token_ids" not in chat


def test_chat_template_kwargs_reach_the_template() -> None:
    class Templated(CharTokenizer):
        chat_template = "any"

        def apply_chat_template(self, messages: Any, add_generation_prompt: bool,
                                tokenize: bool, **kwargs: Any) -> str:
            return f"{messages[-1]['content']}|{sorted(kwargs.items())}"

    req = oa.parse_chat({"model": "m", "messages": [{"role": "user", "content": "q"}],
                         "chat_template_kwargs": {"enable_thinking": False}})
    ids = oa.render_chat(Templated(), req.messages, req.template_kwargs)
    assert CharTokenizer().decode(ids) == "q|[('enable_thinking', False)]"


def test_tools_and_tool_messages_parse() -> None:
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}]
    req = oa.parse_chat({"model": "m", "tools": tools, "tool_choice": "auto", "messages": [
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"}]})
    assert req.tools == [{"type": "function", "function": {
        "name": "add", "description": "", "parameters": tools[0]["function"]["parameters"]}}]
    assert req.messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "id": "c1", "function": {"name": "add", "arguments": {"a": 1}}}]}
    assert req.messages[2] == {"role": "tool", "content": "2", "tool_call_id": "c1"}
    assert oa.parse_chat({"model": "m", "tools": tools, "tool_choice": "none",
                          "messages": [{"role": "user", "content": "x"}]}).tools is None


def test_tool_calls_come_back() -> None:
    text = 'Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    g = oa.Generated(text, [1], [-0.1], "stop")
    body = oa.chat_body("m", [g], [1], oa.Sampling(max_tokens=4), CharTokenizer(),
                        tools=[{"type": "function", "function": {"name": "add"}}])
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me add."
    (called,) = choice["message"]["tool_calls"]
    assert called["function"] == {"name": "add", "arguments": '{"a": 1}'}
    assert called["type"] == "function" and called["id"].startswith("call_")
    plain = oa.chat_body("m", [g], [1], oa.Sampling(max_tokens=4), CharTokenizer())
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": text}
