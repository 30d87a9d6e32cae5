"""OpenAI's completions and chat-completions protocol: request checks and response bodies.

Pure functions over JSON and a tokenizer, shared by the two places marl speaks
it: the inference replica's `/v1` endpoint (served by its engine) and an
episode's recording endpoint (every call a role turn). Neither sees an
unchecked parameter: a value marl cannot honour is a 400 naming the field
(`OpenAIError`), never silently ignored. Supported: `model`, `prompt` (text,
token ids, or a list of either) / `messages` (text content), `max_tokens`
(`max_completion_tokens`), `temperature`, `top_p`, `n`, `seed`, `stop`,
`logprobs` (the sampled tokens' log-probs; alternatives are not computed, so
`top_logprobs` / completions `logprobs` above 0 are refused), and vLLM's
`return_token_ids` and `chat_template_kwargs` extensions, and tools: `tools` (function
schemas, passed to the chat template, or written as Hermes' system message for a
template without tool support), `tool_choice` `auto` or `none`, `tool` messages and
assistant `tool_calls` in the history; a completion's `<tool_call>` blocks come back as
`tool_calls` (finish_reason `tool_calls`). Not supported: streaming, `echo`, `suffix`,
penalties, `logit_bias`, a forced tool choice (sampling is not constrained), the
deprecated `functions`, and non-text content.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

MAX_N = 64
MAX_STOPS = 4
# Accepted and without effect on what is generated.
_IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "stream_options"}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "seed", "stop", "logprobs",
           "stream", "frequency_penalty", "presence_penalty", "logit_bias", "return_token_ids"}
_COMPLETION = _COMMON | {"prompt", "echo", "suffix", "best_of"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                   "functions", "function_call", "response_format", "chat_template_kwargs"}
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class OpenAIError(Exception):
    """An error answer: HTTP status, message, and the offending parameter if any."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", retry: bool = True):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind
        self.retry = retry
        """False: tell clients not to retry (`x-should-retry: false`, which `openai` honours)."""

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": None}}


def bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}", param)


def not_found(model: str, served: list[str]) -> OpenAIError:
    return OpenAIError(404, f"model: {model!r} is not served here (served: "
                            f"{', '.join(served)}); an adapter is named run/policy@version and "
                            "must be loaded on this replica", "model", "not_found_error")


@dataclass
class Sampling:
    max_tokens: int | None
    """None: up to the context length."""
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    return_token_ids: bool = False


@dataclass
class CompletionRequest:
    model: str
    prompts: list[str | list[int]]
    sampling: Sampling


@dataclass
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]
    sampling: Sampling
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Passed to the chat template, e.g. {"enable_thinking": false} (as `model.chat_template_kwargs`)."""
    tools: list[dict[str, Any]] | None = None
    """The function schemas offered (`{"type": "function", "function": {...}}`); None: none."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _check_fields(body: dict[str, Any], known: set[str]) -> None:
    for name in body:
        if name not in known and name not in _IGNORED:
            raise bad(name, "not a parameter marl's OpenAI-compatible endpoint takes")


def _unsupported(body: dict[str, Any], name: str, allowed: tuple[Any, ...], why: str) -> None:
    value = body.get(name)
    if value is not None and value not in allowed:
        raise bad(name, why)


def _sampling(body: dict[str, Any], max_tokens: Any, default_max_tokens: int | None) -> Sampling:  # noqa: C901 (older than the limit; split it when next changed)
    if body.get("stream"):
        raise bad("stream", "streaming is not supported; send stream=false")
    for name in ("frequency_penalty", "presence_penalty"):
        _unsupported(body, name, (0, 0.0), "penalties are not supported; leave it unset or 0")
    _unsupported(body, "logit_bias", ({},), "logit_bias is not supported")
    if max_tokens is None:
        max_tokens = default_max_tokens
    elif not _is_int(max_tokens) or max_tokens < 1:
        raise bad("max_tokens", f"must be an integer >= 1, got {max_tokens!r}")
    temperature = body.get("temperature")
    if temperature is None:
        temperature = 1.0
    if not _is_number(temperature) or temperature < 0:
        raise bad("temperature", f"must be a number >= 0, got {temperature!r}")
    top_p = body.get("top_p")
    if top_p is None:
        top_p = 1.0
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise bad("top_p", f"must be a number in (0, 1], got {top_p!r}")
    n = body.get("n")
    if n is None:
        n = 1
    if not _is_int(n) or not 1 <= n <= MAX_N:
        raise bad("n", f"must be an integer in 1..{MAX_N}, got {n!r}")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise bad("seed", f"must be an integer, got {seed!r}")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if (not isinstance(stop, list) or len(stop) > MAX_STOPS
            or not all(isinstance(s, str) and s for s in stop)):
        raise bad("stop", f"must be a non-empty string or a list of at most {MAX_STOPS}")
    return_ids = body.get("return_token_ids")
    if return_ids is not None and not isinstance(return_ids, bool):
        raise bad("return_token_ids", "must be true or false")
    return Sampling(max_tokens, float(temperature), float(top_p), n, seed, stop,
                    return_token_ids=bool(return_ids))


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "required: the base model's name or run/policy@version "
                           "(GET /v1/models lists them)")
    return model


def parse_completion(body: dict[str, Any], default_max_tokens: int = 16) -> CompletionRequest:
    _check_fields(body, _COMPLETION)
    model = _model(body)
    _unsupported(body, "echo", (False,), "echo is not supported")
    _unsupported(body, "suffix", ("",), "suffix is not supported")
    sampling = _sampling(body, body.get("max_tokens"), default_max_tokens)
    best_of = body.get("best_of")
    if best_of is not None and best_of != sampling.n:
        raise bad("best_of", "best_of other than n is not supported")
    logprobs = body.get("logprobs")
    if logprobs is not None:
        if not _is_int(logprobs) or logprobs < 0:
            raise bad("logprobs", f"must be an integer >= 0, got {logprobs!r}")
        if logprobs > 0:
            raise bad("logprobs", "only 0 is supported: the sampled tokens' log-probs are "
                                  "returned, alternatives are not computed")
        sampling.logprobs = True
    prompt = body.get("prompt")
    prompts: list[str | list[int]]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        prompts = [list(prompt)]
    elif (isinstance(prompt, list) and prompt
          and all(isinstance(p, str) or (isinstance(p, list) and p and all(_is_int(t) for t in p))
                  for p in prompt)):
        prompts = list(prompt)
    else:
        raise bad("prompt", "required: a string, a list of token ids, or a list of either")
    return CompletionRequest(model, prompts, sampling)


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str):
                raise bad(f"{where}[{j}]", "only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(where, "must be a string or a list of text parts")


def parse_chat(body: dict[str, Any], default_max_tokens: int | None = None) -> ChatRequest:
    _check_fields(body, _CHAT)
    model = _model(body)
    _unsupported(body, "functions", ([],), "deprecated by OpenAI; send `tools`")
    _unsupported(body, "function_call", ("none",), "deprecated by OpenAI; send `tool_choice`")
    tools: list[dict[str, Any]] | None = _tools(body.get("tools"))
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise bad("tool_choice", "only auto or none: marl does not constrain sampling to a "
                                 "tool call (the model chooses, as its chat template taught it)")
    if choice == "none":
        tools = None
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise bad("response_format", "only {\"type\": \"text\"} is supported")
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    try:
        sampling = _sampling(body, max_tokens, default_max_tokens)
    except OpenAIError as err:
        if err.param == "max_tokens" and body.get("max_completion_tokens") is not None:
            raise bad("max_completion_tokens", err.message.split(": ", 1)[1]) from None
        raise
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise bad("logprobs", "must be true or false")
    sampling.logprobs = bool(logprobs)
    top = body.get("top_logprobs")
    if top is not None and top != 0:
        raise bad("top_logprobs", "only 0 is supported: alternatives are not computed")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "required: a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", "must be an object with role and content")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}, got "
                                             f"{role!r}")
        out.append(_message(m, str(role), i))
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise bad("chat_template_kwargs", "must be an object of template arguments")
    return ChatRequest(model, out, sampling, dict(kwargs), tools or None)


def _tools(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad("tools", "must be a list of {type: function, function: {name, ...}}")
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if (not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict)
                or not isinstance(fn.get("name"), str) or not fn["name"]):
            raise bad(f"tools[{i}]", "must be {type: function, function: {name, description, "
                                     "parameters}}")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad(f"tools[{i}].function.parameters", "must be a JSON schema object")
        out.append({"type": "function", "function": {
            "name": fn["name"], "description": str(fn.get("description") or ""),
            "parameters": params}})
    return out


def _message(m: dict[str, Any], role: str, i: int) -> dict[str, Any]:
    """One history message as chat templates take it (tool calls' arguments as objects)."""
    calls = m.get("tool_calls")
    if role == "assistant" and calls:
        if not isinstance(calls, list):
            raise bad(f"messages[{i}].tool_calls", "must be a list of tool calls")
        out_calls = []
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise bad(f"messages[{i}].tool_calls[{j}]", "must be {type: function, "
                                                            "function: {name, arguments}}")
            args = fn.get("arguments") or {}
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError:
                    raise bad(f"messages[{i}].tool_calls[{j}].function.arguments",
                              "must be a JSON object (as a string)") from None
            out_calls.append({"type": "function", "id": str(c.get("id") or ""),
                              "function": {"name": fn["name"], "arguments": args}})
        content = m.get("content")
        return {"role": role, "content": "" if content is None else _content(
            content, f"messages[{i}].content"), "tool_calls": out_calls}
    out: dict[str, Any] = {"role": role,
                           "content": _content(m.get("content"), f"messages[{i}].content")}
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if isinstance(m.get(key), str):
                out[key] = m[key]
    return out


# ---------------------------------------------------------------- tokens and text


def render_chat(tokenizer: Any, messages: list[dict[str, Any]],
                template_kwargs: dict[str, Any] | None = None,
                tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Prompt token ids of a chat, exactly as a workflow's role turn renders it (with the
    run's `model.chat_template_kwargs` as `template_kwargs`; `tools` as a tool turn)."""
    extra: dict[str, Any] = {}
    if tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
        from marl.workflows.tools import hermes_messages, supports_tools

        if getattr(tokenizer, "chat_template", None) and supports_tools(tokenizer):
            extra = {"tools": tools} if tools else {}
        else:
            messages = hermes_messages(messages, tools or [])
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False, **extra, **(template_kwargs or {}))
    else:
        text = "\n\n".join(m["content"] for m in messages) + "\n\n"
    return list(tokenizer.encode(str(text), add_special_tokens=False))


def encode_prompt(tokenizer: Any, prompt: str | list[int], vocab_size: int) -> list[int]:
    if isinstance(prompt, str):
        ids = list(tokenizer.encode(prompt))
        if not ids:
            raise bad("prompt", "encodes to no tokens")
        return ids
    if any(not 0 <= t < vocab_size for t in prompt):
        raise bad("prompt", f"token ids must be in 0..{vocab_size - 1}")
    return prompt


def single_token_stops(tokenizer: Any, stops: list[str]) -> list[int]:
    """Stop strings that are one token each, so the engine itself can stop on them."""
    out = []
    for s in stops:
        ids = tokenizer.encode(s, add_special_tokens=False)
        if len(ids) == 1:
            out.append(int(ids[0]))
    return out


@dataclass
class Generated:
    """One choice after stop strings: the text shown and the tokens that produced it."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


def finish(tokenizer: Any, token_ids: list[int], logprobs: list[float], finish_reason: str,
           stops: list[str]) -> Generated:
    """Cut at the first stop string: the text ends before it; the tokens end with the one
    that completed it (what the policy emitted, as with a stop token)."""
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    hits = [text.find(s) for s in stops if s in text]
    if not hits:
        return Generated(text, token_ids, logprobs, finish_reason)
    lo, hi = 1, len(token_ids)
    while lo < hi:  # shortest prefix whose text holds a stop string
        mid = (lo + hi) // 2
        prefix = tokenizer.decode(token_ids[:mid], skip_special_tokens=True)
        if any(s in prefix for s in stops):
            hi = mid
        else:
            lo = mid + 1
    text = tokenizer.decode(token_ids[:lo], skip_special_tokens=True)
    cut = min(text.find(s) for s in stops if s in text)
    return Generated(text[:cut], token_ids[:lo], logprobs[:lo], "stop")


# ---------------------------------------------------------------- responses


def _pieces(tokenizer: Any, token_ids: list[int]) -> list[str]:
    return [tokenizer.decode([t]) for t in token_ids]


def completion_body(model: str, choices: list[Generated], prompt_ids: list[list[int]],
                    sampling: Sampling, tokenizer: Any) -> dict[str, Any]:
    """`choices` are prompt-major: prompt i's n choices are choices[i*n:(i+1)*n]."""
    out = []
    for i, g in enumerate(choices):
        choice: dict[str, Any] = {"index": i, "text": g.text, "logprobs": None,
                                  "finish_reason": g.finish_reason}
        if sampling.logprobs:
            pieces = _pieces(tokenizer, g.token_ids)
            offsets, at = [], 0
            for p in pieces:
                offsets.append(at)
                at += len(p)
            choice["logprobs"] = {"tokens": pieces, "token_logprobs": g.logprobs,
                                  "top_logprobs": None, "text_offset": offsets}
        if sampling.return_token_ids:
            choice["token_ids"] = g.token_ids
            choice["prompt_token_ids"] = prompt_ids[i // sampling.n]
        out.append(choice)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": model, "choices": out,
            "usage": _usage(prompt_ids, choices)}


def tool_call_message(text: str) -> tuple[dict[str, Any], bool]:
    """The assistant message for a completion that offered tools: its well-formed
    `<tool_call>` blocks as `tool_calls` (content: the text before them, or None), and
    whether there were any. A malformed block stays in the content, for the agent to see."""
    from marl.workflows.tools import content_before_calls, parse_tool_calls

    calls = [c for c in parse_tool_calls(text) if c.error is None]
    if not calls:
        return {"role": "assistant", "content": text}, False
    return {"role": "assistant", "content": content_before_calls(text) or None,
            "tool_calls": [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                            "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                           for c in calls]}, True


def chat_body(model: str, choices: list[Generated], prompt_ids: list[int], sampling: Sampling,
              tokenizer: Any, tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    out = []
    for i, g in enumerate(choices):
        message: dict[str, Any] = {"role": "assistant", "content": g.text}
        called = False
        if tools:
            message, called = tool_call_message(g.text)
        choice: dict[str, Any] = {"index": i, "message": message, "logprobs": None,
                                  "finish_reason": "tool_calls" if called else g.finish_reason}
        if sampling.logprobs:
            choice["logprobs"] = {"content": [
                {"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
                for p, lp in zip(_pieces(tokenizer, g.token_ids), g.logprobs, strict=True)]}
        if sampling.return_token_ids:
            choice["token_ids"] = g.token_ids
        out.append(choice)
    body: dict[str, Any] = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                            "created": int(time.time()), "model": model, "choices": out,
                            "usage": _usage([prompt_ids], choices)}
    if sampling.return_token_ids:
        body["prompt_token_ids"] = prompt_ids
    return body


def _usage(prompt_ids: list[list[int]], choices: list[Generated]) -> dict[str, int]:
    prompt = sum(len(p) for p in prompt_ids)
    completion = sum(len(g.token_ids) for g in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def model_entry(model_id: str, created: float, parent: str | None) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": int(created), "owned_by": "marl",
            "root": parent or model_id, "parent": parent}
