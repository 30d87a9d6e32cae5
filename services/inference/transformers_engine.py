"""The transformers engine: many LoRA adapters of one frozen base model.

Requests decode together in one running batch (running_batch.py), each row with its
own adapter (multi_lora.py: rows ordered by adapter, each adapter's delta computed on
its rows only), temperature, top-p, seed and token budget. The batch batches
continuously: a request that arrives while it decodes joins at the next decode step,
and a row's result goes back as soon as it finishes. When the engine is idle, the first
request waits for the rest of its burst (a workflow stage's requests arrive together)
so that they share one prefill: for the bursts of the other workers heard from lately,
not at all when its worker's is the only one. Model work, the base model's load included, runs on
one dedicated thread (marl/runtime/torch_thread.py): the decode loop runs there and hands the
thread to adapter loads between steps, the event loop stays free for gRPC, and one
OpenMP team serves every operator.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AutoTokenizer

from marl.models.causal_lm import load_causal_lm
from marl.models.devices import resolve_device, resolve_dtype
from marl.models.identity import base_model_id
from marl.runtime import tracing
from marl.runtime.heap import release_free_heap
from marl.runtime.torch_thread import TorchThread
from marl.spec.services import InferenceConfig
from services.inference.engine import AdapterWeights, GenerationRequest, GenerationResult
from services.inference.multi_lora import MultiLoRA
from services.inference.running_batch import RunningBatch, make_row

log = logging.getLogger(__name__)

BASE = "__base__"
"""Engine-level key for the bare base model (benchmarks); the gRPC server never routes to it."""
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
RANK_FLOOR = 256
"""Adapter ranks this engine takes even when `max_lora_rank` is lower (it sizes nothing by it)."""


@dataclass
class _Pending:
    request: GenerationRequest
    future: asyncio.Future[GenerationResult]
    loop: asyncio.AbstractEventLoop
    arrived: float = field(default_factory=time.monotonic)

    def settle(self, outcome: GenerationResult | BaseException) -> None:
        """Resolve the caller's future from any thread."""
        settle_all([(self, outcome)])


def settle_all(outcomes: list[tuple[_Pending, GenerationResult | BaseException]]) -> None:
    """Resolve many callers' futures from any thread, with one wake-up of each event loop.

    A decode step often finishes most of the batch at once. A wake-up per row made the
    engine thread trade the GIL with the waking loop once per finished row before its next
    step; one wake-up per loop trades it once."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[GenerationResult],
                                                      GenerationResult | BaseException]]] = {}
    for pending, outcome in outcomes:
        by_loop.setdefault(pending.loop, []).append((pending.future, outcome))
    for loop, settled in by_loop.items():
        loop.call_soon_threadsafe(_settle, settled)


def _settle(settled: list[tuple[asyncio.Future[GenerationResult],
                                GenerationResult | BaseException]]) -> None:
    for future, outcome in settled:
        if future.done():
            continue
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)


def burst_wait_s(
    first: float, newest: float, now: float, waiting: int, enough: int, pause_s: float,
    max_wait_s: float,
) -> float:
    """How much longer the `waiting` requests (the first arrived at `first`, the newest at
    `newest`, time.monotonic()) wait for the rest of their burst before they are prefilled:
    until no request has arrived for `pause_s`, or the first has waited `max_wait_s`, or they
    are `enough` (a full batch; beside a running batch, as many as its rows). The pause
    counts from the newest arrival: counted in fixed ticks of `pause_s` instead, a request
    just after a tick made an idle engine wait up to twice `pause_s` after it, and a
    synchronous demo step's first prefill started later than its last request needed.
    """
    if waiting >= enough:
        return 0.0
    return max(0.0, min(newest + pause_s, first + max_wait_s) - now)


CLIENT_HEARD_S = 10.0
"""How long after its last GenerateMany a client still counts among those whose burst an
idle engine waits for (`every_client_in`)."""


def every_client_in(heard: dict[str, float], waiting: set[str], now: float) -> bool:
    """Whether each client heard from within CLIENT_HEARD_S (`heard`: client -> the
    time.monotonic() of its last request) has requests `waiting`: then no burst is still
    to come, and an idle engine prefills at once instead of pausing for more (one worker's
    GenerateMany is the whole of its burst). Clients not heard from since are forgotten."""
    for client in [c for c, t in heard.items() if now - t >= CLIENT_HEARD_S]:
        del heard[client]
    return bool(heard) and heard.keys() <= waiting


class TransformersEngine:
    name = "transformers"
    lora_slots: int | None = None  # a batch groups its rows by adapter, however many

    def __init__(
        self,
        cfg: InferenceConfig,
        max_batch: int = 256,
        batch_wait_s: float = 0.005,
        max_batch_wait_s: float = 0.05,
        join_running: bool = True,
    ):
        """`cfg`: the model, its dtype, the device (auto: the first GPU when torch sees one)
        and the largest adapter rank (this engine sizes nothing by it, so it takes ranks up
        to `RANK_FLOOR` whatever the config says). `join_running` False: requests wait until
        the running batch has finished (benchmarks compare)."""
        model_path = cfg.model_dir()
        self.model_path = model_path
        self.base_model = base_model_id(model_path)
        self.max_lora_rank = max(cfg.max_lora_rank, RANK_FLOOR)
        self.max_batch = max_batch
        self.batch_wait_s = batch_wait_s
        self.max_batch_wait_s = max_batch_wait_s
        self.join_running = join_running
        tok = AutoTokenizer.from_pretrained(model_path)
        eos = tok.eos_token_id
        self.eos_token_ids = [int(eos)] if eos is not None else []
        self.pad_token_id = int(tok.pad_token_id if tok.pad_token_id is not None else eos or 0)
        self.device = torch.device(resolve_device(cfg.device, field="device"))
        self._thread = TorchThread("engine")
        dtype = _DTYPES[resolve_dtype(cfg.dtype, str(self.device))]
        self.base = self._thread.call(self._load_base, model_path, dtype)
        self.lora = MultiLoRA(self.base)
        self._batch = RunningBatch(self.base, self.lora, self.pad_token_id)
        self._inbox: collections.deque[_Pending] = collections.deque()
        """Requests not yet in the batch: appended on the event loop, taken on the engine
        thread (deque appends and pops are atomic)."""
        self._heard: dict[str, float] = {}
        """GenerateMany client -> when its last request arrived (`every_client_in`)."""
        self._driver: asyncio.Task[None] | None = None
        self._waiting_jobs = 0
        """Adapter loads and unloads queued for the engine thread: the decode loop hands
        the thread over between steps while there are any."""
        self._jobs_lock = threading.Lock()

    def _load_base(self, model_path: str, dtype: torch.dtype) -> Any:
        base = load_causal_lm(model_path, dtype)
        torch.nn.Module.to(base, self.device)
        return base.eval()

    async def _run_between_steps(self, fn, *args):  # type: ignore[no-untyped-def]
        """`fn` on the engine thread, which the decode loop leaves at its next step."""
        with self._jobs_lock:
            self._waiting_jobs += 1

        def job():  # type: ignore[no-untyped-def]
            with self._jobs_lock:
                self._waiting_jobs -= 1
            return fn(*args)

        return await self._thread.run(job)

    # adapters ---------------------------------------------------------------

    async def load_adapter(self, adapter: AdapterWeights) -> None:
        await self._run_between_steps(self._load, adapter)

    def _load(self, adapter: AdapterWeights) -> None:
        try:
            self.lora.load(
                adapter.key,
                adapter.rank,
                adapter.alpha,
                adapter.target_modules,
                adapter.state_dict,
            )
        except ValueError as err:
            raise ValueError(f"adapter {adapter.key}: {err}") from None

    async def unload_adapter(self, key: str) -> None:
        await self._run_between_steps(self.lora.unload, key)

    async def release_free_heap(self) -> None:
        await self._run_between_steps(release_free_heap)

    # generation -------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if request.adapter_key != BASE and request.adapter_key not in self.lora.loaded:
            raise KeyError(f"adapter {request.adapter_key} is not loaded")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[GenerationResult] = loop.create_future()
        pending = _Pending(request, fut, loop)
        self._inbox.append(pending)
        if request.client:
            self._heard[request.client] = pending.arrived
        if self._driver is None:
            self._driver = asyncio.create_task(self._drive())
        return await fut

    async def _drive(self) -> None:
        """Keep the decode loop on the engine thread while there is work; ends when idle."""
        try:
            while self._inbox or self._batch.rows:
                if not self._batch.rows:
                    with tracing.span("burst wait"):
                        await self._gather_burst()
                await self._thread.run(self._decode_loop)
                if not self._batch.rows and not self._inbox:
                    # the batch's KV cache and logits were freed on the engine thread, whose
                    # glibc arena keeps them otherwise: RSS would follow the largest batch
                    await self._thread.run(release_free_heap)
        finally:
            self._driver = None

    async def _gather_burst(self) -> None:
        """Requests of one workflow stage arrive as a burst (one GenerateMany call a worker):
        wait until every client heard from lately has sent its part (`every_client_in`),
        or else until the burst pauses (`burst_wait_s`)."""
        inbox = self._inbox
        while inbox and not every_client_in(
            self._heard, {p.request.client for p in inbox}, time.monotonic()
        ) and (left := burst_wait_s(
            inbox[0].arrived, inbox[-1].arrived, time.monotonic(), len(inbox),
            self.max_batch, self.batch_wait_s, self.max_batch_wait_s,
        )) > 0:
            await asyncio.sleep(left)

    def _decode_loop(self) -> None:
        """On the engine thread: admit waiting requests and decode step by step until the
        batch is empty or an adapter load waits for the thread."""
        batch = self._batch
        while True:
            if self._admitting():
                taken: list[_Pending] = []
                while self._inbox and len(batch.rows) + len(taken) < self.max_batch:
                    taken.append(self._inbox.popleft())
                self._admit(taken)
            abandoned = [r for r in batch.rows if r.tag.future.cancelled()]
            if abandoned:
                batch.drop(abandoned)
            if not batch.rows or self._waiting_jobs:
                return
            try:
                with tracing.span("decode", rows=len(batch.rows)):
                    finished = batch.step()
            except Exception as err:
                log.exception("decode step of %d rows failed", len(batch.rows))
                settle_all([(row.tag, err) for row in batch.clear()])
                continue
            settle_all([(row.tag, row.result()) for row in finished])

    def _admitting(self) -> bool:
        """Whether waiting requests join now. Joining a running batch costs a forward of
        its own (the newcomers' prefill), so newcomers join as the idle engine gathers a
        burst (`burst_wait_s`), joining at once when they are as many as the running rows."""
        batch, inbox = self._batch, self._inbox
        if not inbox or len(batch.rows) >= self.max_batch or not batch.can_admit():
            return False
        if not batch.rows:
            return True
        if not self.join_running:
            return False
        return burst_wait_s(
            inbox[0].arrived, inbox[-1].arrived, time.monotonic(), len(inbox),
            len(batch.rows), self.batch_wait_s, self.max_batch_wait_s,
        ) == 0

    def _admit(self, pending: list[_Pending]) -> None:
        """Prefill `pending` into the batch; if that fails, admit each alone, so a failure
        stays with the request that caused it (requests are checked before they queue)."""
        rows = []
        for p in pending:
            key = p.request.adapter_key
            if key != BASE and key not in self.lora.loaded:
                p.settle(KeyError(f"adapter {key} was unloaded"))
                continue
            adapter = None if key == BASE else key
            rows.append(make_row(p.request, adapter, self.eos_token_ids, tag=p))
        if not rows:
            return
        try:
            with tracing.span("prefill", rows=len(rows)):
                finished = self._batch.admit(rows)
        except Exception as err:
            if len(rows) > 1:
                log.warning("prefill of %d requests failed (%s); admitting them one by one",
                            len(rows), str(err)[:200])
                for row in rows:
                    self._admit([row.tag])
                return
            log.exception("request failed")
            rows[0].tag.settle(err)
            return
        settle_all([(row.tag, row.result()) for row in finished])

    async def close(self) -> None:
        if self._driver is not None:
            self._driver.cancel()
        self._thread.close()

