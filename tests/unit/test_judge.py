"""The judge: asked over OpenAI's protocol at any endpoint and recorded untrained, or a
trained role when a policy group names it."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web
from pydantic import ValidationError

from marl.runtime.http_server import HttpServer
from marl.spec.run import JudgeSpec, parse_spec
from marl.workflows import policy_of_role
from tests.support.workflows_scripted import MATH, ScriptedEngine, make_task, runner_with


def test_the_judge_is_routed_only_when_a_policy_group_names_it() -> None:
    judged = {"judge": {"model": "base"}}
    assert "judge" not in policy_of_role(parse_spec({"reward": judged}))
    spec = parse_spec({"reward": judged, "policy_groups": {
        "generator": "solver", "aggregator": "solver", "judge": "judge"}})
    assert policy_of_role(spec) == {"generator": "solver", "aggregator": "solver",
                                    "judge": "judge"}


async def test_an_openai_endpoint_judges_and_its_turn_is_recorded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict[str, Any]] = []

    async def chat(request: web.Request) -> web.Response:
        seen.append({"auth": request.headers.get("Authorization"), **await request.json()})
        return web.json_response({"choices": [{"index": 0, "finish_reason": "stop",
                                               "message": {"role": "assistant",
                                                           "content": "Good. \\boxed{8}"}}]})

    http = HttpServer("127.0.0.1", 0)
    http.app.router.add_post("/v1/chat/completions", chat)
    await http.start()
    monkeypatch.setenv("MARL_JUDGE_KEY_GRADER", "sk-test")
    try:
        judge = JudgeSpec(endpoint=f"http://{http.address}/v1", model="grader",
                          api_key_env="MARL_JUDGE_KEY_GRADER", max_tokens=5).model_dump()
        engine = ScriptedEngine(lambda role, slot, prompt: "it is \\boxed{5}")
        rollout = await runner_with(engine, judge_endpoints=[f"http://{http.address}/v1/"]
                                    ).run(make_task("single", judge=judge))
    finally:
        await http.stop()
    assert rollout.error is None, rollout.error
    assert rollout.reward == 0.8 and rollout.facts["judge_parsed"] == 1.0
    (asked,) = seen
    assert asked["auth"] == "Bearer sk-test" and asked["model"] == "grader"
    assert asked["max_tokens"] == 5 and "return_token_ids" not in asked
    assert MATH.prompt in asked["messages"][0]["content"]
    assert "it is \\boxed{5}" in asked["messages"][0]["content"]
    (turn,) = rollout.judge_turns
    assert turn.role == "judge" and turn.text == "Good. \\boxed{8}"
    assert [t.role for t in rollout.turns] == ["generator"]  # not trained


async def test_a_judge_that_does_not_answer_fails_the_rollout() -> None:
    judge = JudgeSpec(endpoint="http://127.0.0.1:9/v1", timeout_s=2).model_dump()
    engine = ScriptedEngine(lambda role, slot, prompt: "x")
    rollout = await runner_with(engine, judge_endpoints=["http://127.0.0.1:9/v1"]).run(
        make_task("single", judge=judge))
    assert rollout.error is not None and "did not answer" in rollout.error


async def test_a_worker_sends_a_judge_request_only_where_its_operator_allows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A task is input from Redis: the worker re-checks the judge endpoint against its own
    `judge_endpoints`, and reads a key only from a MARL_JUDGE_KEY_* variable, whatever the
    task says. Either refusal fails the rollout before any request leaves the worker."""
    monkeypatch.setenv("MARL_AUTH_TOKEN", "the-service-secret")
    engine = ScriptedEngine(lambda role, slot, prompt: "x")
    judge = JudgeSpec(endpoint="http://127.0.0.1:9/v1", timeout_s=2).model_dump()
    rollout = await runner_with(engine).run(make_task("single", judge=judge))
    assert rollout.error is not None
    assert "reward.judge.endpoint" in rollout.error and "MARL_WORKFLOW_JUDGE_ENDPOINTS" in (
        rollout.error)
    stolen = {**judge, "api_key_env": "MARL_AUTH_TOKEN"}  # past the RunSpec's own check
    rollout = await runner_with(engine, judge_endpoints=["http://127.0.0.1:9/v1"]).run(
        make_task("single", judge=stolen))
    assert rollout.error is not None and "MARL_JUDGE_KEY_*" in rollout.error


def test_a_spec_names_a_judge_key_only_in_marl_judge_key_variables() -> None:
    with pytest.raises(ValidationError, match="MARL_JUDGE_KEY_"):
        JudgeSpec(endpoint="http://judge/v1", api_key_env="MARL_AUTH_TOKEN")
    assert JudgeSpec(api_key_env="MARL_JUDGE_KEY_OPENAI").api_key_env == "MARL_JUDGE_KEY_OPENAI"
