"""The transformers + PEFT engine: many LoRA adapters of one frozen base model.

Concurrent `generate` calls are decoded together with a KV cache (up to `max_batch`
rows), left-padded, each row with its own adapter (PEFT's mixed-adapter forward),
temperature, top-p, seed and token budget. Batching is continuous (continuous.py):
a request that arrives while a batch runs joins it at the next decode step, and a
finished row leaves it at once.
Model work runs on one dedicated thread so loads and batches never overlap and
the event loop stays free for gRPC.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
from dataclasses import dataclass

import torch
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from transformers import AutoModelForCausalLM, AutoTokenizer

from marl.model_id import base_model_id
from services.inference.continuous import RunningBatch
from services.inference.engine import AdapterWeights, GenerationRequest, GenerationResult

log = logging.getLogger(__name__)

BASE = "__base__"
"""Engine-level key for the bare base model (benchmarks); the gRPC server never routes to it."""
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class _Pending:
    request: GenerationRequest
    future: asyncio.Future[GenerationResult]


def _internal_name(int_id: int) -> str:
    # PEFT adapter names become module keys: no dots, no slashes.
    return f"lora_{int_id}"


class TransformersEngine:
    name = "transformers"

    def __init__(
        self,
        model_path: str,
        dtype: str = "float32",
        max_batch: int = 256,
        max_lora_rank: int = 256,
        batch_wait_s: float = 0.005,
        max_batch_wait_s: float = 0.05,
    ):
        self.model_path = model_path
        self.base_model = base_model_id(model_path)
        self.max_lora_rank = max_lora_rank
        self.max_batch = max_batch
        self.batch_wait_s = batch_wait_s
        self.max_batch_wait_s = max_batch_wait_s
        tok = AutoTokenizer.from_pretrained(model_path)
        eos = tok.eos_token_id
        self.eos_token_ids = [int(eos)] if eos is not None else []
        self.pad_token_id = int(tok.pad_token_id if tok.pad_token_id is not None else eos or 0)
        self.base = AutoModelForCausalLM.from_pretrained(model_path, dtype=_DTYPES[dtype])
        self.base.eval()
        self.model: PeftModel | None = None
        self._names: dict[str, str] = {}
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._inbox: queue.SimpleQueue[_Pending] = queue.SimpleQueue()
        """Requests not yet in a batch; the model thread takes them between decode steps."""
        self._wake = asyncio.Event()
        self._exclusive = 0
        """Adapter loads/unloads waiting for the model thread; while any is, no request
        joins the running batch."""
        self._loop_task: asyncio.Task[None] | None = None

    async def _run(self, fn, *args):  # type: ignore[no-untyped-def]
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    # adapters ---------------------------------------------------------------

    async def load_adapter(self, adapter: AdapterWeights) -> None:
        await self._exclusively(self._load, adapter)

    async def _exclusively(self, fn, *args):  # type: ignore[no-untyped-def]
        """Run `fn` on the model thread once the running batch has drained: no request
        joins it meanwhile, so a load or unload waits at most for the rows under way."""
        self._exclusive += 1
        try:
            return await self._run(fn, *args)
        finally:
            self._exclusive -= 1

    def _load(self, adapter: AdapterWeights) -> None:
        name = _internal_name(adapter.int_id)
        config = LoraConfig(
            r=adapter.rank,
            lora_alpha=adapter.alpha,  # type: ignore[arg-type]  # PEFT accepts floats
            lora_dropout=0.0,
            target_modules=adapter.target_modules,
            bias="none",
        )
        if self.model is None:
            self.model = get_peft_model(self.base, config, adapter_name=name)
        else:
            self.model.add_adapter(name, config)
        result = set_peft_model_state_dict(self.model, adapter.state_dict, adapter_name=name)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            if self._names:
                self.model.delete_adapter(name)
            else:  # PEFT cannot delete its only adapter: go back to the bare base model
                self.base = self.model.unload()
                self.model = None
            raise ValueError(f"adapter {adapter.key}: unexpected weights {unexpected[:3]}")
        assert self.model is not None
        self.model.eval()
        self._names[adapter.key] = name

    async def unload_adapter(self, key: str) -> None:
        await self._exclusively(self._unload, key)

    def _unload(self, key: str) -> None:
        name = self._names.pop(key)
        assert self.model is not None
        if self._names:
            self.model.delete_adapter(name)
        else:  # PEFT keeps its last adapter marked active after deleting it: back to the bare base
            self.base = self.model.unload()
            self.model = None

    # generation -------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if request.adapter_key != BASE and request.adapter_key not in self._names:
            raise KeyError(f"adapter {request.adapter_key} is not loaded")
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._batch_loop())
        fut: asyncio.Future[GenerationResult] = asyncio.get_running_loop().create_future()
        self._inbox.put(_Pending(request, fut))
        self._wake.set()
        return await fut

    async def _batch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            if self._inbox.empty():
                await self._wake.wait()
                continue
            # Requests of one workflow stage arrive as a burst: let it gather (until it
            # pauses, or long enough) so the first prefill is one batch; later arrivals
            # join the running batch at its next step.
            deadline = loop.time() + self.max_batch_wait_s
            seen = self._inbox.qsize()
            while loop.time() < deadline and seen < self.max_batch:
                await asyncio.sleep(self.batch_wait_s)
                if self._inbox.qsize() == seen:
                    break
                seen = self._inbox.qsize()
            try:
                await self._run(self._decode_until_idle, loop)
            except Exception:  # a fault outside any one request's: keep serving the rest
                log.exception("decode loop failed")

    @torch.no_grad()
    def _decode_until_idle(self, loop: asyncio.AbstractEventLoop) -> None:
        """Decode until no row is left: arrivals join before each step (while no adapter
        load or unload is waiting for this thread), finished rows are answered at once."""
        batch = RunningBatch(self.pad_token_id, self.eos_token_ids)
        try:
            self._decode(batch, loop)
        except BaseException as err:
            for row in batch.fail_all():
                self._answer(loop, row.owner, error=err)
            raise

    def _decode(self, batch: RunningBatch, loop: asyncio.AbstractEventLoop) -> None:
        while True:
            if not self._exclusive and batch.joinable():
                arrivals: list[_Pending] = []
                while len(batch.rows) + len(arrivals) < self.max_batch:
                    try:
                        arrivals.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                if arrivals:
                    self._admit(batch, arrivals, loop)
            if not batch.rows:
                if self._exclusive or self._inbox.empty():
                    return
                continue
            model, routed = self._current_model()
            try:
                finished = batch.step(model, routed)
            except Exception as err:
                log.exception("decode step failed; failing its %d requests", len(batch.rows))
                for row in batch.fail_all():
                    self._answer(loop, row.owner, error=err)
                continue
            for row in finished:
                self._answer(loop, row.owner, row.result())

    def _current_model(self) -> tuple[torch.nn.Module, bool]:
        if self.model is None:  # no adapter loaded: only base requests can be here
            return self.base, False
        return self.model, True

    def _admit(
        self, batch: RunningBatch, arrivals: list[_Pending], loop: asyncio.AbstractEventLoop
    ) -> None:
        """Prefill `arrivals` into `batch`; if the group fails, each request alone, so a
        failure stays with the request that caused it (requests are checked before they
        queue, so this is rare)."""
        rows = []
        for p in arrivals:
            key = p.request.adapter_key
            name = BASE if key == BASE else self._names.get(key)
            if name is None:
                self._answer(loop, p, error=KeyError(f"adapter {key} was unloaded"))
                continue
            rows.append(batch.new_row(p.request, name, p))
        if not rows:
            return
        model, routed = self._current_model()
        try:
            for row in batch.admit(model, rows, routed):
                self._answer(loop, row.owner, row.result())
        except Exception as err:
            if len(rows) == 1:
                log.exception("request failed")
                self._answer(loop, rows[0].owner, error=err)
                return
            log.warning("prefill of %d requests failed (%s); admitting them one by one",
                        len(rows), str(err)[:200])
            for row in rows:
                self._admit(batch, [row.owner], loop)

    @staticmethod
    def _answer(
        loop: asyncio.AbstractEventLoop,
        pending: _Pending,
        result: GenerationResult | None = None,
        error: BaseException | None = None,
    ) -> None:
        def settle() -> None:
            if pending.future.done():
                return
            if error is not None:
                pending.future.set_exception(error)
            else:
                pending.future.set_result(result)  # type: ignore[arg-type]

        loop.call_soon_threadsafe(settle)

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        self._thread.shutdown(wait=False, cancel_futures=True)
