"""The transformers engine: many LoRA adapters of one frozen base model.

Concurrent `generate` calls are gathered into batches (up to `max_batch`) and
decoded together with a KV cache, left-padded, each row with its own adapter
(multi_lora.py: rows ordered by adapter, each adapter's delta computed on its
rows only), temperature, top-p, seed and token budget. Model work, the base
model's load included, runs on one dedicated thread (marl/torch_thread.py), so
loads and batches never overlap, the event loop stays free for gRPC, and one
OpenMP team serves every operator.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from marl.devices import resolve_device
from marl.heap import release_free_heap
from marl.model_id import base_model_id
from marl.torch_thread import TorchThread
from services.inference.engine import AdapterWeights, GenerationRequest, GenerationResult
from services.inference.multi_lora import MultiLoRA

log = logging.getLogger(__name__)

BASE = "__base__"
"""Engine-level key for the bare base model (benchmarks); the gRPC server never routes to it."""
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class _Pending:
    request: GenerationRequest
    future: asyncio.Future[GenerationResult]


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
        device: str = "auto",
    ):
        """`device`: auto (the first GPU when torch sees one), cpu or cuda."""
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
        self.device = torch.device(resolve_device(device, field="device"))
        self._thread = TorchThread("engine")
        self.base = self._thread.call(self._load_base, model_path, _DTYPES[dtype])
        self.lora = MultiLoRA(self.base)
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self._loop_task: asyncio.Task[None] | None = None

    def _load_base(self, model_path: str, dtype: torch.dtype) -> Any:
        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        torch.nn.Module.to(base, self.device)
        return base.eval()

    async def _run(self, fn, *args):  # type: ignore[no-untyped-def]
        return await self._thread.run(fn, *args)

    # adapters ---------------------------------------------------------------

    async def load_adapter(self, adapter: AdapterWeights) -> None:
        await self._run(self._load, adapter)

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
        await self._run(self.lora.unload, key)

    # generation -------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if request.adapter_key != BASE and request.adapter_key not in self.lora.loaded:
            raise KeyError(f"adapter {request.adapter_key} is not loaded")
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._batch_loop())
        fut: asyncio.Future[GenerationResult] = asyncio.get_running_loop().create_future()
        await self._queue.put(_Pending(request, fut))
        return await fut

    async def _batch_loop(self) -> None:
        while True:
            batch = [await self._queue.get()]
            # Requests of one workflow stage arrive as a burst: keep gathering
            # until the burst pauses (or the batch is full / waited long enough).
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.max_batch_wait_s
            while len(batch) < self.max_batch:
                if self._queue.empty():
                    await asyncio.sleep(self.batch_wait_s)
                    if self._queue.empty() or loop.time() > deadline:
                        break
                batch.append(self._queue.get_nowait())
            await self._decode(batch)

    async def _decode(self, batch: list[_Pending]) -> None:
        """Decode `batch`; if it fails, decode each request alone so a failure stays with the
        request that caused it (requests are checked before they queue, so this is rare)."""
        try:
            results = await self._run(self._generate_batch, [p.request for p in batch])
        except Exception as err:
            if len(batch) > 1:
                log.warning(
                    "batch of %d failed (%s); decoding its requests one by one",
                    len(batch),
                    str(err)[:200],
                )
                for p in batch:
                    await self._decode([p])
                return
            log.exception("request failed")
            if not batch[0].future.done():
                batch[0].future.set_exception(err)
            return
        for p, res in zip(batch, results, strict=True):
            if not p.future.done():
                p.future.set_result(res)
        # a batch's KV cache and logits were freed on the engine thread, whose glibc arena
        # keeps them otherwise: the replica's RSS would follow its largest batch
        await self._run(release_free_heap)

    @torch.no_grad()
    def _generate_batch(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        adapters = [None if r.adapter_key == BASE else r.adapter_key for r in requests]
        missing = [a for a in adapters if a is not None and a not in self.lora.loaded]
        if missing:
            raise KeyError(f"adapter {missing[0]} was unloaded")
        # rows of one adapter side by side: each adapter's delta is one slice of the batch
        order = sorted(
            range(len(requests)), key=lambda i: (adapters[i] is not None, adapters[i] or "")
        )
        with self.lora.route([adapters[i] for i in order]):
            results = decode_batch(
                self.base, [requests[i] for i in order], self.eos_token_ids, self.pad_token_id
            )
        by_row = dict(zip(order, results, strict=True))
        return [by_row[i] for i in range(len(requests))]

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        self._thread.close()


def _sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    generators: list[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row sampling; returns (token ids, their log-probs under the sampling distribution)."""
    logits = logits.float()
    greedy = temperature <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    if bool((top_p < 1).any()):
        sorted_lp, idx = torch.sort(logp, dim=-1, descending=True)
        cum = sorted_lp.exp().cumsum(-1)
        drop_sorted = (cum - sorted_lp.exp()) >= top_p[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        logp = torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)
    uniform = torch.rand(logp.shape, device=logp.device)  # rows without a seed: one draw
    for i, gen in enumerate(generators):
        if gen is not None:
            uniform[i] = torch.rand(logp.shape[-1], generator=gen, device=logp.device)
    gumbel = -torch.log(-torch.log(uniform.clamp_min(1e-20)))
    sampled = torch.argmax(logp + gumbel, dim=-1)
    tokens = torch.where(greedy, torch.argmax(logp, dim=-1), sampled)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def decode_batch(
    model: torch.nn.Module,
    requests: list[GenerationRequest],
    eos_token_ids: list[int],
    pad_token_id: int,
) -> list[GenerationResult]:
    """Left-padded batched decoding with a KV cache (the caller routes rows to adapters)."""
    n = len(requests)
    device = next(model.parameters()).device
    width = max(len(r.prompt_token_ids) for r in requests)
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, r in enumerate(requests):
        ids = r.prompt_token_ids
        input_ids[i, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        mask[i, width - len(ids) :] = 1
    input_ids, mask = input_ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    temperature = torch.tensor([r.temperature for r in requests], device=device)
    top_p = torch.tensor([r.top_p if 0 < r.top_p < 1 else 1.0 for r in requests], device=device)
    generators: list[torch.Generator | None] = []
    for r in requests:
        generators.append(
            None if r.seed is None else torch.Generator(device=device).manual_seed(r.seed)
        )
    stops = [set(eos_token_ids) | set(r.stop_token_ids) for r in requests]
    budget = torch.tensor([r.max_tokens for r in requests])
    out_tokens: list[list[int]] = [[] for _ in requests]
    out_logps: list[list[float]] = [[] for _ in requests]
    finish = ["length"] * n
    done = [False] * n
    past = None
    step_ids, step_pos = input_ids, positions
    for t in range(int(budget.max())):
        out = model(
            input_ids=step_ids,
            attention_mask=mask,
            position_ids=step_pos,
            past_key_values=past,
            use_cache=True,
        )
        past = out.past_key_values
        tokens, logps = _sample(out.logits[:, -1, :], temperature, top_p, generators)
        step_tokens, step_logps = tokens.tolist(), logps.tolist()
        for i in range(n):
            if done[i]:
                continue
            tok = int(step_tokens[i])
            out_tokens[i].append(tok)
            out_logps[i].append(float(step_logps[i]))
            if tok in stops[i]:
                finish[i] = "stop"
                done[i] = True
            elif t + 1 >= int(budget[i]):
                done[i] = True
        if all(done):
            break
        step_ids = tokens[:, None]
        step_pos = step_pos[:, -1:] + 1
        mask = torch.cat([mask, torch.ones((n, 1), dtype=torch.long, device=device)], dim=-1)
    return [
        GenerationResult(token_ids=toks, logprobs=lps, finish_reason=fr)
        for toks, lps, fr in zip(out_tokens, out_logps, finish, strict=True)
    ]
