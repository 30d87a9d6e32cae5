"""The worker's runtime around a workflow: caps, seeds, chat templates, and which failures
make a failed rollout (left out of training) versus a bug (raised, task left pending)."""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from pathlib import Path
from typing import Any

import grpc
import pytest

from marl.models.demo import demo_model_dir
from marl.rollout import Task
from marl.spec.run import WorkflowCaps
from marl.workflows import prompts, resolve
from services.workflow import episode_runtime as episode_module
from services.workflow import worker
from services.workflow.episode_runtime import PromptTooLong, Renders
from services.workflow.worker import EpisodeRunner
from tests.support.loop_ticks import loop_ticks
from tests.support.workflows_scripted import (
    MATH,
    CharTokenizer,
    ScriptedEngine,
    make_episode,
    make_task,
    runner_with,
)


async def test_a_prompt_over_its_cap_fails_the_episode_naming_the_cap() -> None:
    engine = ScriptedEngine(lambda role, slot, prompt: "\\boxed{5}")
    task = make_task("voting", caps=WorkflowCaps(prompt_tokens_math=20))
    rollout = await runner_with(engine).run(task)
    assert rollout.error is not None and rollout.error.startswith("PromptTooLong")
    assert "prompt cap of 20" in rollout.error and "caps.prompt_tokens_math" in rollout.error
    assert rollout.turns == [] and rollout.reward == 0.0
    assert engine.seen == []


async def test_the_paper_caps_apply_when_the_spec_leaves_them_unset() -> None:
    long = "x" * 20481
    engine = ScriptedEngine(lambda role, slot, prompt: "\\boxed{5}")
    task = make_task("single")
    task.problem = type(task.problem)(id="long", prompt=long, answer="5")
    with pytest.raises(PromptTooLong, match="20480"):
        await make_episode(task, engine).turn("generator", 0, prompts.generator(task.problem))


class Unreachable:
    async def Generate(self, request: Any, timeout: float | None = None) -> Any:  # noqa: N802
        raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(),
                                   grpc.aio.Metadata(), "deadline")


async def test_inference_unreachable_is_a_failed_episode() -> None:
    rollout = await runner_with(Unreachable()).run(make_task("single"))
    assert rollout.error is not None and "DEADLINE_EXCEEDED" in rollout.error


class Refuses:
    def __init__(self, code: grpc.StatusCode):
        self.code = code
        self.calls = 0

    async def Generate(self, request: Any, timeout: float | None = None) -> Any:  # noqa: N802
        self.calls += 1
        raise grpc.aio.AioRpcError(self.code, grpc.aio.Metadata(), grpc.aio.Metadata(), "no")


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE,
                                  grpc.StatusCode.FAILED_PRECONDITION,
                                  grpc.StatusCode.CANCELLED])
async def test_a_turn_a_replica_did_not_take_goes_to_the_next(code: grpc.StatusCode) -> None:
    """CANCELLED is what a stopping replica answers a call no handler took yet."""
    refusing = Refuses(code)
    serving = ScriptedEngine(lambda role, slot, prompt: "\\boxed{5}")
    runner = EpisodeRunner(None, "w-test", replica_wait_s=0, judge_endpoints=())
    runner._tokenizers[""] = CharTokenizer()

    task = make_task("single")
    first = zlib.crc32(f"{task.run_id}:{task.problem.id}".encode()) % 2  # the turn's replica

    async def stubs(fresh: bool = False) -> list[Any]:
        return [refusing, serving] if first == 0 else [serving, refusing]

    runner.stubs = stubs  # type: ignore[method-assign]
    rollout = await runner.run(task)
    assert rollout.error is None and rollout.reward == 1.0
    assert refusing.calls == 1 and len(serving.seen) == 1


async def test_every_replica_refusing_is_a_failed_episode() -> None:
    rollout = await runner_with(Refuses(grpc.StatusCode.CANCELLED)).run(make_task("single"))
    assert rollout.error is not None and rollout.error.startswith("NoReplica: ")
    assert "CANCELLED" in rollout.error


async def test_no_live_replica_is_a_failed_episode() -> None:
    runner = EpisodeRunner(None, "w-test", replica_wait_s=0, judge_endpoints=())
    runner._tokenizers[""] = CharTokenizer()

    async def no_replicas(fresh: bool = False) -> list[Any]:
        from services.workflow.episode_runtime import NoReplica

        raise NoReplica("no live inference replica is registered in Redis")

    runner.stubs = no_replicas  # type: ignore[method-assign]
    rollout = await runner.run(make_task("single"))
    assert rollout.error == "NoReplica: no live inference replica is registered in Redis"
    assert runner.stats.failed == 1


async def test_a_bug_in_a_workflow_propagates(monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(episode: Any, problem: Any) -> str:
        return {}["missing"]  # type: ignore[no-any-return]

    engine = ScriptedEngine(lambda role, slot, prompt: "\\boxed{5}")
    runner = runner_with(engine)
    workflow = resolve("voting")
    monkeypatch.setattr("services.workflow.worker.resolve",
                        lambda name: type(workflow)(name="voting", roles=workflow.roles,
                                                    run=broken))
    with pytest.raises(KeyError):
        await runner.run(make_task("voting"))
    assert runner.stats.failed == 0


async def test_unknown_grpc_errors_are_bugs_too() -> None:
    class Refusing:
        async def Generate(self, request: Any, timeout: float | None = None) -> Any:  # noqa: N802
            raise grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(), "bad request")

    with pytest.raises(grpc.aio.AioRpcError):
        await runner_with(Refusing()).run(make_task("single"))


async def test_a_code_task_without_a_sandbox_is_a_failed_episode() -> None:
    from tests.support.workflows_scripted import CODE

    engine = ScriptedEngine(lambda role, slot, prompt: "```python\nx = 1\n```")
    rollout = await runner_with(engine).run(make_task("single", problem=CODE))
    assert rollout.error is not None and "--sandbox" in rollout.error


async def test_one_sandbox_client_per_worker_reused_and_closed() -> None:
    runner = EpisodeRunner(None, "w-test", sandbox_address="127.0.0.1:1", replica_wait_s=0, judge_endpoints=())
    first = runner.sandbox()
    assert runner.sandbox() is first
    await runner.close()
    assert first.channel.get_state() == grpc.ChannelConnectivity.SHUTDOWN


async def seeds_of(task: Task) -> list[tuple[str, int, int]]:
    engine = ScriptedEngine(lambda role, slot, prompt: "\\boxed{Incorrect} \\boxed{5}")
    episode = make_episode(task, engine)
    await resolve(task.workflow).run(episode, task.problem)
    return [(s.role, s.slot, s.seed) for s in engine.seen]


async def test_turn_seeds_are_reproducible_and_distinct() -> None:
    first = await seeds_of(make_task("eval_opt", seed=4))
    again = await seeds_of(make_task("eval_opt", seed=4))
    other_run = await seeds_of(make_task("eval_opt", seed=5))
    assert first == again
    seeds = [s for _, _, s in first]
    assert all(s > 0 for s in seeds) and len(set(seeds)) == len(seeds) == 7
    assert set(seeds).isdisjoint(s for _, _, s in other_run)
    voting = await seeds_of(make_task("voting", seed=4))
    assert len({s for _, _, s in voting}) == 4  # three parallel generators sample apart


async def test_validation_seeds_name_no_step_so_every_checkpoint_draws_the_same() -> None:
    def at(kind: str, step: int) -> Task:
        task = make_task("voting", seed=4)
        task.kind, task.step = kind, step  # type: ignore[assignment]
        return task

    ten, twenty = await seeds_of(at("val", 10)), await seeds_of(at("val", 20))
    assert ten == twenty
    assert len({s for _, _, s in ten}) == 4  # the parallel generators still draw apart
    trained = [await seeds_of(at("train", step)) for step in (10, 20)]
    assert {s for _, _, s in trained[0]}.isdisjoint(s for _, _, s in trained[1])
    assert {s for _, _, s in ten}.isdisjoint(s for _, _, s in trained[0])


class TemplateTokenizer(CharTokenizer):
    chat_template = "set"  # type: ignore[assignment]

    def __init__(self) -> None:
        self.kwargs: list[dict[str, Any]] = []

    def apply_chat_template(self, messages: Any, **kwargs: Any) -> str:
        self.kwargs.append(kwargs)
        return "<chat>" + messages[0]["content"]


async def test_chat_template_kwargs_reach_the_template_and_chat_template_false_skips_it() -> None:
    engine = ScriptedEngine(lambda role, slot, prompt: "\\boxed{5}")
    tok = TemplateTokenizer()
    task = make_task("single", chat_template_kwargs={"enable_thinking": False})
    await make_episode(task, engine, tokenizer=tok).turn("generator", 0, [
        {"role": "user", "content": "hi"}])
    assert tok.kwargs == [{"add_generation_prompt": True, "tokenize": False,
                           "enable_thinking": False}]
    assert engine.seen[-1].prompt == "<chat>hi"
    plain = make_task("single", chat_template=False)
    await make_episode(plain, engine, tokenizer=tok).turn("generator", 0, [
        {"role": "user", "content": "hi"}])
    assert engine.seen[-1].prompt == "hi\n\n" and len(tok.kwargs) == 1


async def test_a_worker_renders_each_prompt_once_and_not_a_clock_reading_template() -> None:
    engine = ScriptedEngine(lambda role, slot, prompt: "\\boxed{5}")
    tok = TemplateTokenizer()
    renders = Renders(tok)
    task = make_task("single", chat_template_kwargs={"enable_thinking": False})
    for content in ("hi", "hi", "ho"):
        episode = make_episode(task, engine, tokenizer=tok)
        episode.renders = renders
        await episode.turn("generator", 0, [{"role": "user", "content": content}])
    assert [s.prompt for s in engine.seen] == ["<chat>hi", "<chat>hi", "<chat>ho"]
    assert len(tok.kwargs) == 2  # "hi" rendered once
    other = make_task("single", chat_template_kwargs={"enable_thinking": True})
    episode = make_episode(other, engine, tokenizer=tok)
    episode.renders = renders
    await episode.turn("generator", 0, [{"role": "user", "content": "hi"}])
    assert len(tok.kwargs) == 3  # other template settings: rendered anew

    dated = TemplateTokenizer()
    dated.chat_template = "{{ strftime_now('%d %b %Y') }}"
    assert not Renders(dated).on


def test_rendered_prompts_are_bounded_by_their_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(episode_module, "RENDERED_TOKENS_KEPT", 5)
    renders = Renders(TemplateTokenizer())
    renders.put("a", [1, 2, 3])
    renders.put("b", [4, 5])
    assert renders.get("a") == [1, 2, 3] and renders.get("b") == [4, 5]
    renders.put("c", [6])  # over 5 tokens: emptied first
    assert renders.get("a") is None and renders.get("c") == [6]


async def test_problems_spread_over_replicas_and_a_group_meets_on_one() -> None:
    replicas = [ScriptedEngine(lambda role, slot, prompt: "\\boxed{5}") for _ in range(2)]
    runner = EpisodeRunner(None, "w-test", replica_wait_s=0, judge_endpoints=())
    runner._tokenizers[""] = CharTokenizer()

    async def stubs(fresh: bool = False) -> list[Any]:
        return list(replicas)

    runner.stubs = stubs  # type: ignore[method-assign]
    problems = [type(MATH)(id=f"p{k}", prompt=f"What is {k} + 3?", answer=str(k + 3))
                for k in range(12)]
    for problem in problems:
        for sample in range(4):
            task = make_task("single", problem=problem)
            task.sample = sample
            assert (await runner.run(task)).error is None
    served = [{p.id for p in problems if any(p.prompt in s.prompt for s in r.seen)}
              for r in replicas]
    assert served[0] and served[1] and not served[0] & served[1]
    assert sum(len(r.seen) for r in replicas) == 48


async def test_a_models_tokenizer_loads_once_in_a_thread_while_the_loop_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loads: list[str] = []

    def slow_load(model_path: str) -> Any:
        loads.append(model_path)
        time.sleep(0.3)  # what a real tokenizer's load costs, held off the event loop
        return CharTokenizer()

    monkeypatch.setattr(worker, "load_tokenizer", slow_load)
    runner = EpisodeRunner(None, "w-test", replica_wait_s=0, judge_endpoints=())
    async with loop_ticks(0.01) as ticks:
        first_episodes = await asyncio.gather(*(runner.tokenizer("/models/m") for _ in range(3)))
    assert loads == ["/models/m"]
    assert first_episodes[0] is first_episodes[1] is first_episodes[2]
    assert ticks.count >= 10  # 0.3 s of load, the loop ticking every 10 ms beside it
    assert await runner.tokenizer("/models/m") is first_episodes[0]
    assert loads == ["/models/m"]


def failing_once_then_loading(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Makes the worker's first tokenizer load fail and its second succeed; the answers
    left to give are returned."""
    answers: list[Any] = [OSError("no tokenizer files in /models/m"), CharTokenizer()]

    def load(model_path: str) -> Any:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(worker, "load_tokenizer", load)
    return answers


async def test_a_failed_tokenizer_load_is_tried_again_by_the_next_episode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    answers = failing_once_then_loading(monkeypatch)
    runner = EpisodeRunner(None, "w-test", replica_wait_s=0, judge_endpoints=())
    with pytest.raises(OSError, match="no tokenizer files"):
        await runner.tokenizer("/models/m")
    assert isinstance(await runner.tokenizer("/models/m"), CharTokenizer)
    assert answers == []


async def test_the_demo_models_tokenizer_loads_from_its_directory() -> None:
    runner = EpisodeRunner(None, "w-test", replica_wait_s=0, judge_endpoints=())
    tokenizer = await runner.tokenizer(str(demo_model_dir()))
    ids = tokenizer.encode("Solve 1 and 2", add_special_tokens=False)
    assert len(ids) == 4 and tokenizer.unk_token_id not in ids
    assert await runner.tokenizer(str(demo_model_dir())) is tokenizer


async def test_a_preloaded_tokenizer_serves_episodes_that_name_its_directory_another_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loads: list[str] = []

    def load(model_path: str) -> Any:
        loads.append(model_path)
        return CharTokenizer()

    monkeypatch.setattr(worker, "load_tokenizer", load)
    (tmp_path / "model").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "model")
    runner = EpisodeRunner(None, "w-test", replica_wait_s=0, judge_endpoints=())
    runner.preload([str(tmp_path / "model")])
    runner.preload([str(tmp_path / "model")])  # a second announcement while it loads
    tokenizer = await runner.tokenizer(str(tmp_path / "link"))
    assert loads == [str(tmp_path / "model")]
    assert await runner.tokenizer(str(tmp_path / "model")) is tokenizer
    runner.preload([str(tmp_path / "model")])
    assert loads == [str(tmp_path / "model")]


async def test_a_failed_preload_is_not_repeated_and_an_episode_tries_again(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    answers = failing_once_then_loading(monkeypatch)
    runner = EpisodeRunner(None, "w-test", replica_wait_s=0, judge_endpoints=())
    with caplog.at_level(logging.INFO, logger=worker.__name__):
        runner.preload(["/models/m"])
        await asyncio.gather(*runner._loading.values(), return_exceptions=True)
        runner.preload(["/models/m"])
        await asyncio.gather(*runner._loading.values(), return_exceptions=True)
    assert len(answers) == 1  # one attempt, however often the replica is announced
    assert "no tokenizer preloaded from /models/m (no tokenizer files" in caplog.text
    assert isinstance(await runner.tokenizer("/models/m"), CharTokenizer)
    assert answers == []
