"""One episode's runtime: a role turn goes through the chat template to inference.

Workflows (`marl/workflows/`) only call `turn(role, slot, messages)`; this
renders the messages, checks the prompt against its cap, picks the role's
adapter version, derives the turn's sampling seed, and records every turn's
token ids, sampling log-probs, finish reason and serving adapter version.

Turns are recorded in the order they started, not the order they finished: parallel
slots (Voting's generators) finish in whatever order the engine gets to them, and the
learner's mini-batch shuffle is seeded over the sequences in rollout order, so a
finishing order in the record would make the same rollouts train differently.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import json
import time
import uuid
import zlib
from array import array
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import grpc

from marl.protocol.rpc_codes import SERVER_GONE
from marl.protocol.v1 import common_pb2, inference_pb2
from marl.rollout import AdapterRef, Task, Turn
from marl.workflows.base import Caps, EpisodeError

GENERATE_DEADLINE_S = 600.0
RENDERED_TOKENS_KEPT = 1 << 20
"""Prompt tokens a worker keeps rendered per model (`Renders`, about 8 bytes a token plus
the messages); the cache is emptied when it holds more."""

REPLICA_POLL_S = 0.5
"""How often a turn waiting for a replica (`Episode.replica_wait_s`) reads the registry."""

SERVED_ELSEWHERE = (*SERVER_GONE, grpc.StatusCode.FAILED_PRECONDITION)
"""Codes that send a turn on to the next replica: the replica is down, stopping or joining
(UNAVAILABLE, CANCELLED), or it serves but does not hold the adapter version (another may:
one the learner's push reached first)."""


class PromptTooLong(EpisodeError):
    """A rendered role prompt is over the workflow's prompt cap."""


class NoReplica(EpisodeError):
    """No inference replica could serve the turn."""


NONE_REGISTERED = "no live inference replica is registered in Redis"


def turn_seed(task: Task, role: str, slot: int, nth: int) -> int:
    """A nonzero 63-bit sampling seed from the run seed and the task (not the run id, which
    is random per submission), the role, the slot and the n-th turn of that role slot.

    A training turn's seed also names its step, so each step draws afresh. A validation
    turn's does not: every checkpoint samples a problem's slots with the same draws, so
    two validations differ only where the adapters do (an unchanged adapter writes the
    same texts), while parallel slots still draw apart."""
    step = task.step if task.kind == "train" else "-"
    key = f"{task.seed}:{task.kind}:{step}:{task.problem.id}:{task.sample}:{role}:{slot}:{nth}"
    value = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") & (2**63 - 1)
    return value or 1


class Renders:
    """Prompt token ids by (messages, template settings), for one tokenizer: a group's
    samples, and every step's repeats of a problem, render the same messages, and the
    chat template costs more than the rest of a short turn. Off for a template that reads
    the clock (`strftime_now`), whose rendering is not a function of its input."""

    def __init__(self, tokenizer: Any):
        self.on = "strftime_now" not in str(getattr(tokenizer, "chat_template", None) or "")
        self._ids: dict[str, array[int]] = {}
        self._tokens = 0

    def get(self, key: str) -> list[int] | None:
        ids = self._ids.get(key) if self.on else None
        return None if ids is None else ids.tolist()

    def put(self, key: str, ids: list[int]) -> None:
        if not self.on:
            return
        if self._tokens + len(ids) > RENDERED_TOKENS_KEPT:
            self._ids.clear()
            self._tokens = 0
        self._ids[key] = array("q", ids)
        self._tokens += len(ids)


class GenerateStub(Protocol):
    """What an episode calls a replica through: an InferenceStub, or the worker's
    BatchingStub (which sends its concurrent calls as one)."""

    def Generate(  # noqa: N802 (the gRPC method's name)
        self, request: inference_pb2.GenerateRequest, timeout: float | None = None
    ) -> Awaitable[inference_pb2.GenerateResponse]: ...


class Episode:
    def __init__(
        self,
        task: Task,
        tokenizer: Any,
        stubs: Sequence[GenerateStub],
        caps: Caps,
        oracle: Callable[[str], Awaitable[bool]] | None = None,
        renders: Renders | None = None,
    ):
        self.task = task
        self.tokenizer = tokenizer
        self.renders = renders
        """The worker's rendered prompts for this tokenizer (None: render every turn)."""
        self.stubs = stubs
        self.restub: Callable[[], Awaitable[Sequence[GenerateStub]]] | None = None
        """Stubs from a fresh read of the replica registry (set by the worker), for a turn
        that every replica of `stubs` turned away: the worker's list may be a heartbeat old,
        missing a replica that turned serving since, while the listed one stops."""
        self.replica_wait_s = 0.0
        """How long such a turn goes on reading the registry (every `REPLICA_POLL_S`) for a
        replica that takes it, before its episode fails with NoReplica: long enough for the
        only replica to restart. 0: one fresh read (set by the worker)."""
        self.turns: list[Turn] = []
        """Every finished turn, in the order the turns started."""
        self._turn_starts: list[int] = []
        """The start number of each of `turns`."""
        self._started_turns = 0
        self._caps = caps
        self._facts: dict[str, float] = {}
        self._oracle = oracle
        self._next = zlib.crc32(f"{task.run_id}:{task.problem.id}".encode())
        """The replica of the first turn, by problem: problems spread over the replicas, and
        a group's samples (one problem) meet on one, where they share a prefill."""
        self._started: dict[tuple[str, int], int] = {}
        self.context: int | None = None
        """The base model's context window (set by the worker): a prompt that fills it fails
        the episode here, as one over the cap does, instead of being refused by inference."""
        self.args: Any = None
        """The run's `workflow_args` as the workflow's model made them (set by the worker)."""
        self.role_rewards: dict[str, float] = {}
        """Rewards of single roles the workflow set (see `marl.workflows.Episode`)."""
        self.judge_turns: list[Turn] = []
        """The judge's turns when its role is not trained (marl/rewards/llm_judge.py)."""
        self.tool_roles: set[str] = set()
        """Roles that offered tools this episode (their `role/<r>/tool_errors` is logged)."""
        self.sandbox_client: Callable[[], Any] | None = None
        """The worker's reward sandbox client (set by the worker)."""
        self.judge_client: Callable[[Task], Awaitable[Any]] | None = None
        """The run's judge endpoint (set by the worker; services/workflow/judge_client.py)."""

    @property
    def caps(self) -> Caps:
        return self._caps

    @property
    def facts(self) -> dict[str, float]:
        return self._facts

    async def correct(self, answer: str) -> bool:
        if self._oracle is None:
            raise EpisodeError("this episode has no scorer for `correct`")
        return await self._oracle(answer)

    async def openai_base_url(self) -> str:
        """An OpenAI-compatible endpoint whose chat calls are this episode's role turns."""
        from services.workflow import openai_proxy

        return await openai_proxy.base_url(self)

    def sandbox(self) -> Any:
        """The reward sandbox client (reward functions, the `python` tool)."""
        if self.sandbox_client is None:
            raise EpisodeError("this episode has no reward sandbox")
        return self.sandbox_client()

    async def judge(self, messages: list[dict[str, str]]) -> str:
        """The run's judge answers `messages` (marl/rewards/llm_judge.py)."""
        from services.workflow.judge_client import ask

        return await ask(self, messages)

    async def tool_turn(self, role: str, slot: int, messages: list[dict[str, Any]],
                        tools: Sequence[Any], max_tool_calls: int | None = None) -> str:
        """A role turn that may call `tools` (services/workflow/tool_turns.py)."""
        from services.workflow.tool_turns import tool_turn

        return await tool_turn(self, role, slot, messages, tools, max_tool_calls)

    def render(self, messages: list[dict[str, Any]],
               tools: list[dict[str, Any]] | None = None) -> list[int]:
        if self.renders is None:
            return self._render(messages, tools)
        key = json.dumps(
            [self.task.chat_template, self.task.chat_template_kwargs, messages]
            + ([tools] if tools else []), sort_keys=True
        )
        ids = self.renders.get(key)
        if ids is None:
            ids = self._render(messages, tools)
            self.renders.put(key, ids)
        return ids

    def _render(self, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None = None) -> list[int]:
        templated = self.task.chat_template and getattr(self.tokenizer, "chat_template", None)
        extra: dict[str, Any] = {}
        if tools:
            from marl.workflows.tools import hermes_messages, supports_tools

            if templated and supports_tools(self.tokenizer):
                extra["tools"] = tools
            else:
                messages = hermes_messages(messages, tools)
        if templated:
            text = self.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=True,
                tokenize=False,
                **extra,
                **self.task.chat_template_kwargs,
            )
        else:
            text = "\n\n".join(m["content"] for m in messages) + "\n\n"
        return list(self.tokenizer.encode(str(text), add_special_tokens=False))

    async def turn(self, role: str, slot: int, messages: list[dict[str, str]]) -> str:
        return (await self.run_turn(role, slot, messages)).text

    async def run_turn(self, role: str, slot: int, messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None = None) -> Turn:
        """One role turn through inference (`tools`: the JSON schemas the prompt offers);
        its record, also kept in `turns`."""
        start = self._started_turns
        self._started_turns += 1
        ref = self.task.adapters.get(role)
        if ref is None:
            raise ValueError(
                f"role {role!r} is not a role of workflow {self.task.workflow!r} "
                f"(roles: {', '.join(self.task.adapters)})"
            )
        nth = self._started.get((role, slot), 0)
        self._started[(role, slot)] = nth + 1
        prompt_ids = self.render(messages, tools)
        if len(prompt_ids) > self._caps.prompt_tokens:
            raise PromptTooLong(
                f"the {role} prompt (slot {slot}) is {len(prompt_ids)} tokens, over the "
                f"{self.task.problem.task} prompt cap of {self._caps.prompt_tokens} "
                f"(caps.prompt_tokens_{self.task.problem.task})"
            )
        if self.context is not None and len(prompt_ids) >= self.context:
            raise PromptTooLong(
                f"the {role} prompt (slot {slot}) is {len(prompt_ids)} tokens and fills the "
                f"model's context of {self.context}; lower caps.prompt_tokens_"
                f"{self.task.problem.task} below it"
            )
        request = inference_pb2.GenerateRequest(
            prompt_token_ids=prompt_ids,
            adapter=common_pb2.AdapterRef(name=ref.name, version=ref.version),
            sampling=inference_pb2.SamplingParams(
                max_tokens=self.task.max_tokens,
                temperature=self.task.temperature,
                top_p=self.task.top_p,
                seed=turn_seed(self.task, role, slot, nth),
            ),
            request_id=f"{self.task.id}:{role}:{slot}:{uuid.uuid4().hex[:6]}",
            newest_adapter=self.task.staleness_scope == "turn",
        )
        resp, refusal = await self._generate(request)
        if resp is None and self.restub is not None:
            resp, refusal = await self._generate_fresh(request, refusal)
        if resp is None:
            raise NoReplica(
                f"no inference replica could serve {ref.name}@{ref.version}: "
                f"{refusal or NONE_REGISTERED}"
            )
        self._next += 1
        completion = list(resp.token_ids)
        text = self.tokenizer.decode(completion, skip_special_tokens=True)
        record = Turn(
            role=role,
            slot=slot,
            prompt_ids=prompt_ids,
            completion_ids=completion,
            logprobs=list(resp.logprobs),
            finish_reason=resp.finish_reason,
            adapter=AdapterRef(resp.served_by.name, resp.served_by.version),
            text=str(text),
        )
        at = bisect.bisect(self._turn_starts, start)
        self._turn_starts.insert(at, start)
        self.turns.insert(at, record)
        return record

    async def _generate_fresh(
        self, request: inference_pb2.GenerateRequest, refusal: grpc.aio.AioRpcError | None
    ) -> tuple[inference_pb2.GenerateResponse | None, grpc.aio.AioRpcError | None]:
        """`_generate` over fresh replica lists (`restub`): one at once, then one every
        `REPLICA_POLL_S` while no replica is up to take the turn (each refusal says the
        server is gone, or none is registered: the only replica restarting), until one
        answers or `replica_wait_s` has passed. A serving replica that does not hold the
        turn's adapter version ends the wait: no restart brings that version back."""
        assert self.restub is not None
        deadline = time.monotonic() + self.replica_wait_s
        while True:
            try:
                self.stubs = await self.restub()
            except NoReplica:
                self.stubs = []
            resp, refused = await self._generate(request)
            refusal = refused or refusal
            left = deadline - time.monotonic()
            gone = refused is None or refused.code() in SERVER_GONE
            if resp is not None or left <= 0 or not gone:
                return resp, refusal
            await asyncio.sleep(min(REPLICA_POLL_S, left))

    async def _generate(
        self, request: inference_pb2.GenerateRequest
    ) -> tuple[inference_pb2.GenerateResponse | None, grpc.aio.AioRpcError | None]:
        """The first answer of `stubs`, tried in turn from this turn's replica; or none, and
        a refusal, when each turned the call away (`SERVED_ELSEWHERE`): the last one, or
        a replica's that is up but does not hold the adapter version, if any was."""
        refusal = None
        for attempt in range(len(self.stubs)):
            stub = self.stubs[(self._next + attempt) % len(self.stubs)]
            try:
                return await stub.Generate(request, timeout=GENERATE_DEADLINE_S), None
            except grpc.aio.AioRpcError as err:
                if err.code() not in SERVED_ELSEWHERE:
                    raise
                if refusal is None or refusal.code() in SERVER_GONE:
                    refusal = err
        return None, refusal
