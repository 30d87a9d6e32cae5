"""A scripted inference engine for workflow unit tests.

The real runtime `Episode` (rendering, prompt caps, routing, seeds, recording)
talks to this in place of an inference replica: each Generate answers with the
text a script returns for (role, slot, prompt), after an optional delay, and
remembers every request it saw. `runner_with` is a worker's `EpisodeRunner` whose
only replica is such an engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from marl.problem import Problem
from marl.protocol.v1 import common_pb2, inference_pb2
from marl.rollout import AdapterRef, Task
from marl.spec.code_refs import CodePolicy
from marl.spec.run import WorkflowCaps
from marl.workflows import resolve
from services.workflow.episode_runtime import Episode
from services.workflow.worker import EpisodeRunner


class CharTokenizer:
    """One token per character; no chat template (prompts render as plain text)."""

    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids)


@dataclass
class Seen:
    role: str
    slot: int
    prompt: str
    adapter: str
    seed: int
    started: float
    ended: float = 0.0


Script = Callable[[str, int, str], str]


@dataclass
class ScriptedEngine:
    script: Script
    delay_s: float = 0.0
    seen: list[Seen] = field(default_factory=list)

    async def Generate(  # noqa: N802 (the gRPC method's name)
        self, request: inference_pb2.GenerateRequest, timeout: float | None = None
    ) -> inference_pb2.GenerateResponse:
        _, role, slot, _ = request.request_id.rsplit(":", 3)
        prompt = "".join(chr(i) for i in request.prompt_token_ids)
        loop = asyncio.get_running_loop()
        seen = Seen(role, int(slot), prompt,
                    f"{request.adapter.name}@{request.adapter.version}",
                    request.sampling.seed, loop.time())
        self.seen.append(seen)
        await asyncio.sleep(self.delay_s)
        seen.ended = loop.time()
        text = self.script(role, int(slot), prompt)
        return inference_pb2.GenerateResponse(
            token_ids=[ord(c) for c in text],
            logprobs=[-0.25] * len(text),
            finish_reason="stop",
            served_by=common_pb2.AdapterRef(name=request.adapter.name,
                                            version=request.adapter.version),
            request_id=request.request_id,
        )


MATH = Problem(id="p1", prompt="What is 2 + 3?", answer="5")
CODE = Problem(id="c1", prompt="Write f.", task="code",
               tests=[{"fn_name": "f", "args": [], "expected": 1}])


def make_task(workflow: str, problem: Problem = MATH, routing: str = "isolated",
              caps: WorkflowCaps | None = None, seed: int = 0, **extra: Any) -> Task:
    roles = resolve(workflow).roles
    return Task(
        run_id="run-1", step=3, kind="train", problem=problem, sample=1, workflow=workflow,
        adapters={r: AdapterRef(f"run-1/{r if routing == 'isolated' else 'shared'}", 7)
                  for r in roles},
        model_path="", temperature=1.0, top_p=1.0, max_tokens=64,
        caps=(caps or WorkflowCaps()).model_dump(), seed=seed, **extra,
    )


def make_episode(task: Task, engine: ScriptedEngine, tokenizer: Any = None,
                 truth: Callable[[str], bool] | None = None) -> Episode:
    """The runtime's Episode on the scripted engine; `truth` is the oracle (default: the
    answer contains `\\boxed{5}`)."""
    caps = resolve(task.workflow).caps_for(WorkflowCaps(**task.caps), task.problem.task)
    judge = truth or (lambda text: "\\boxed{5}" in text)

    async def oracle(text: str) -> bool:
        return judge(text)

    return Episode(task, tokenizer or CharTokenizer(), [engine], caps, oracle)  # type: ignore[list-item]


async def run_episode(task: Task, engine: ScriptedEngine, **kw: Any) -> tuple[Episode, str]:
    episode = make_episode(task, engine, **kw)
    final = await resolve(task.workflow).run(episode, task.problem)
    return episode, final


TEST_CODE = CodePolicy(("tests", "examples"))
"""The test suite's own workflows and rewards, as a worker's `allowed_modules` would allow."""


def runner_with(engine: Any, **options: Any) -> EpisodeRunner:
    options.setdefault("code", TEST_CODE)
    options.setdefault("judge_endpoints", ())
    runner = EpisodeRunner(None, "w-test", replica_wait_s=0, **options)
    runner._tokenizers[""] = CharTokenizer()

    async def stubs(fresh: bool = False) -> list[Any]:
        return [engine]

    runner.stubs = stubs  # type: ignore[method-assign]
    return runner
