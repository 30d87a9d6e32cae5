"""Tools a workflow turn may offer the model: Python callables with a JSON schema.

    from marl.workflows.tools import tool, CALCULATOR, PYTHON

    @tool
    def lookup(word: str) -> str:
        "The definition of a word."
        return DICTIONARY.get(word, "not found")

    text = await episode.tool_turn("solver", 0, messages, [lookup, CALCULATOR, PYTHON],
                                   max_tool_calls=4)

The model calls a tool in the format its chat template teaches: Qwen3's and
Hermes' `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the tools are
passed to the template as `tools=`; a template without tool support gets the
same instructions in a system message). Each call runs (a sync tool in a thread,
an async one on the loop, within its `timeout_s`) and its result goes back as a
`tool` message; the turn goes on until the model answers without a call, or has
made `max_tool_calls`, or the next prompt would pass the prompt cap.

A malformed call (no JSON, no name, arguments not an object), an unknown tool,
arguments the tool does not take, a tool that raises and one that times out are
answered with an `error: ...` tool message, never a failed episode, and counted
(`role/<r>/tool_errors`). A sync tool that times out keeps its thread until it
returns: a tool that can hang should be async, or run its work in the sandbox
(the built-in `python` tool does).

Every model call of a tool turn is its own recorded turn, its prompt the whole
exchange so far as the model saw it: tool outputs are prompt tokens of the next
call, recorded there and never in the loss (the learner's loss covers completion
tokens only), and each call's sampling log-probs are those of the exact context
it was sampled in (no re-tokenisation of earlier calls).
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, get_type_hints

TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
RESULT_CHARS = 4000
"""A tool result longer than this is cut (with a note): it goes into the next prompt."""

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean",
               list: "array", dict: "object"}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    """JSON schema of the arguments (an object)."""
    fn: Callable[..., Any]
    """Called with the arguments as keywords (and `episode=` if it takes that); sync or
    async; returns anything `str()` can show."""
    timeout_s: float = 30.0

    def schema(self) -> dict[str, Any]:
        """The OpenAI/chat-template form: `{"type": "function", "function": {...}}`."""
        return {"type": "function", "function": {"name": self.name,
                                                 "description": self.description,
                                                 "parameters": self.parameters}}


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None,
         description: str | None = None, parameters: dict[str, Any] | None = None,
         timeout_s: float = 30.0) -> Any:
    """A `Tool` from a function: its name, docstring and a JSON schema from its annotated
    parameters (str, int, float, bool, list, dict), unless given."""

    def make(f: Callable[..., Any]) -> Tool:
        return Tool(name or f.__name__, description or inspect.getdoc(f) or f.__name__,
                    parameters or schema_of(f), f, timeout_s)

    return make(fn) if fn is not None else make


def schema_of(fn: Callable[..., Any]) -> dict[str, Any]:
    hints = get_type_hints(fn)
    props: dict[str, Any] = {}
    required = []
    for p in inspect.signature(fn).parameters.values():
        if p.name == "episode" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        kind = _JSON_TYPES.get(hints.get(p.name, str), "string")
        props[p.name] = {"type": kind}
        if p.default is inspect.Parameter.empty:
            required.append(p.name)
    return {"type": "object", "properties": props, "required": required}


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    """Why the call could not be read (malformed); it is answered with this error."""


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>...</tool_call>` in `text`, in order (an unclosed last one too:
    a malformed call). The body is `{"name": str, "arguments": object or JSON string}`."""
    calls = []
    for m in TOOL_CALL.finditer(text):
        body = m.group(1).strip()
        try:
            data = json.loads(body)
        except json.JSONDecodeError as err:
            calls.append(ToolCall("", error=f"malformed tool call: not JSON ({err.msg}); write "
                                            '<tool_call>{"name": ..., "arguments": {...}}'
                                            "</tool_call>"))
            continue
        name = data.get("name") if isinstance(data, dict) else None
        args = data.get("arguments", {}) if isinstance(data, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                args = None
        if not isinstance(name, str) or not name:
            calls.append(ToolCall("", error="malformed tool call: no `name`"))
        elif not isinstance(args, dict):
            calls.append(ToolCall(name, error="malformed tool call: `arguments` must be a "
                                              "JSON object"))
        else:
            calls.append(ToolCall(name, args))
    return calls


def content_before_calls(text: str) -> str:
    """The assistant's text before its first tool call (what the template shows as content)."""
    return text.split("<tool_call>", 1)[0].strip()


def _shown(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str) if isinstance(
        value, dict | list) else str(value)
    if len(text) > RESULT_CHARS:
        text = text[:RESULT_CHARS] + f"\n... ({len(text) - RESULT_CHARS} more characters cut)"
    return text


async def execute(call: ToolCall, tools: Mapping[str, Tool], episode: Any) -> tuple[str, bool]:
    """(the tool message's content, whether it is an error)."""
    if call.error is not None:
        return f"error: {call.error}", True
    found = tools.get(call.name)
    if found is None:
        return (f"error: unknown tool {call.name!r}; the tools are "
                f"{', '.join(sorted(tools)) or 'none'}"), True
    params = inspect.signature(found.fn).parameters
    kwargs = dict(call.arguments)
    if "episode" in params:
        kwargs["episode"] = episode
    try:
        inspect.signature(found.fn).bind(**kwargs)
    except TypeError as err:
        return f"error: {call.name} does not take these arguments ({err})", True
    try:
        if inspect.iscoroutinefunction(found.fn):
            result = await asyncio.wait_for(found.fn(**kwargs), found.timeout_s)
        else:
            result = await asyncio.wait_for(asyncio.to_thread(found.fn, **kwargs),
                                            found.timeout_s)
    except TimeoutError:
        return f"error: {call.name} timed out after {found.timeout_s:g} s", True
    except Exception as err:  # the tool's failure is the model's to read, not the episode's
        return f"error: {call.name} raised {type(err).__name__}: {err}", True
    return _shown(result), False


def assistant_message(text: str, calls: Sequence[ToolCall]) -> dict[str, Any]:
    """The model's message with its tool calls, as chat templates take it."""
    return {"role": "assistant", "content": content_before_calls(text), "tool_calls": [
        {"type": "function", "function": {"name": c.name or "invalid", "arguments": c.arguments}}
        for c in calls]}


def tool_message(name: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "name": name, "content": content}


HERMES_SYSTEM = (
    "You may call tools. Their signatures are within <tools></tools>:\n<tools>\n{tools}\n"
    "</tools>\nTo call one, write <tool_call>\n{{\"name\": <name>, \"arguments\": "
    "<arguments object>}}\n</tool_call>; its result comes back as the tool's response."
)


def supports_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders `tools` and tool messages itself."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template and "tool" in template


def hermes_messages(messages: Sequence[Mapping[str, Any]],
                    tools: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    """The exchange for a template without tool support: the tools in a system message
    (Hermes' format), calls as `<tool_call>` text, results as `<tool_response>` user text."""
    listing = "\n".join(json.dumps(t, sort_keys=True) for t in tools)
    out = [{"role": "system", "content": HERMES_SYSTEM.format(tools=listing)}]
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user",
                        "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(
                "<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                              "arguments": c["function"]["arguments"]})
                + "\n</tool_call>" for c in m["tool_calls"])
            out.append({"role": "assistant",
                        "content": f"{m.get('content') or ''}\n{calls}".strip()})
        elif m["role"] == "system" and out[0]["role"] == "system" and len(out) == 1:
            out[0]["content"] = f"{m['content']}\n\n{out[0]['content']}"
        else:
            out.append({"role": str(m["role"]), "content": str(m.get("content") or "")})
    return out


# ---------------------------------------------------------------- built-in tools

_OPS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos,
}
MAX_POWER = 1000


def _evaluate(node: ast.AST) -> float | int:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not (
            isinstance(node.value, bool)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_POWER:
            raise ValueError(f"exponent over {MAX_POWER}")
        return _OPS[type(node.op)](left, right)  # type: ignore[no-any-return]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.operand))  # type: ignore[no-any-return]
    raise ValueError("only numbers and + - * / // % ** ( ) are allowed")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression, e.g. (3 + 4) * 2 / 7."""
    value = _evaluate(ast.parse(expression.strip(), mode="eval"))
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


CALCULATOR = Tool("calculator", "Evaluate an arithmetic expression, e.g. (3 + 4) * 2 / 7.",
                  {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}, calculate, timeout_s=5.0)


async def run_python(code: str, episode: Any) -> str:
    """Run Python code in the reward sandbox (its isolation and limits); its output."""
    result = await episode.sandbox().execute(code, [{"stdin": "", "expected_stdout": ""}],
                                              limits={"timeout_seconds": 10})
    r = result.results[0] if result.results else None
    if r is None:
        return "error: the sandbox returned no result"
    out = r.stdout + (f"\n[stderr]\n{r.stderr}" if r.stderr.strip() else "")
    if r.verdict not in ("PASSED", "FAILED"):
        out += f"\n[{r.verdict}]{' ' + r.error if r.error else ''}"
    return out.strip() or "(no output)"


PYTHON = Tool("python", "Run Python code and see what it prints (stdout and stderr).",
              {"type": "object", "properties": {"code": {"type": "string"}},
               "required": ["code"]}, run_python, timeout_s=30.0)

BUILTIN_TOOLS = {"calculator": CALCULATOR, "python": PYTHON}
"""Built-in tools by name (a workflow's `workflow_args` may choose among them)."""


def named_tool(name: str, field: str = "workflow_args.tools") -> Tool:
    """The tool a run spec names (in its `workflow_args`): a built-in, or one an installed
    package registers in the `marl.tools` entry-point group. A name is only ever looked up
    there, never imported as a module path (marl/spec/code_refs.py); anything else is a
    SpecError naming `field`."""
    from marl.spec import code_refs
    from marl.spec.run import SpecError

    if name in BUILTIN_TOOLS:
        return BUILTIN_TOOLS[name]
    installed = code_refs.entry_points(code_refs.GROUPS["tool"])
    if name not in installed:
        known = ", ".join([*BUILTIN_TOOLS, *installed])
        raise SpecError(f"field `{field}`: no tool named {code_refs.shorten(name)!r}; the "
                        f"tools here are {known}")
    value = code_refs.load(installed[name], field)
    if not isinstance(value, Tool):
        raise SpecError(f"field `{field}`: the installed tool {name!r} is a "
                        f"{type(value).__name__}, not a marl.workflows.tools.Tool")
    return value
