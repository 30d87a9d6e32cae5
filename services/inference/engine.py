"""The engine interface every inference backend implements.

An engine serves one frozen base model and any number of LoRA adapters, each
loaded under a unique key (`run/policy@version`) and int id, and generates from
token ids with a per-request adapter. Engines batch concurrent `generate` calls
themselves. Version bookkeeping (immutability, in-flight counts, retention)
lives above the engine, in `adapters.AdapterRegistry`, so every engine shares it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from marl.models.limits import ModelLimits

if TYPE_CHECKING:
    import torch


@dataclass
class GenerationRequest:
    prompt_token_ids: list[int]
    adapter_key: str
    """Key of a loaded adapter (`run/policy@version`)."""
    max_tokens: int
    temperature: float = 1.0
    """0 = greedy."""
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    """Generation ends after emitting one of these (the tokenizer's EOS is always included)."""
    client: str = ""
    """The peer of the GenerateMany call it came in ("" for any other request): an idle
    transformers engine waits for the bursts of the clients it has heard from lately."""


@dataclass
class GenerationResult:
    token_ids: list[int]
    logprobs: list[float]
    """Log-probability of each generated token under the sampling distribution
    (logits / temperature; the raw distribution when greedy)."""
    finish_reason: str
    """`stop` (a stop token was emitted) or `length` (max_tokens reached)."""


@dataclass
class AdapterWeights:
    key: str
    """`run/policy@version`; never reused for other weights."""
    int_id: int
    """Unique positive id for engines that need one (vLLM's lora_int_id)."""
    rank: int
    alpha: float
    target_modules: list[str]
    state_dict: dict[str, torch.Tensor]
    """PEFT-format keys, as `get_peft_model_state_dict` returns them."""


class Engine(Protocol):
    name: str
    """`transformers` or `vllm`."""
    base_model: str
    """Identity of the served base model (its directory's name + config hash)."""
    max_lora_rank: int
    lora_slots: int | None
    """Adapter versions one batch can mix (vLLM's `max_loras`); None: any number. A request
    for another version waits until a batch has room for it."""
    eos_token_ids: list[int]

    async def generate(self, request: GenerationRequest) -> GenerationResult: ...

    async def load_adapter(self, adapter: AdapterWeights) -> None:
        """Load and make ready; returns only when requests can use it."""
        ...

    async def unload_adapter(self, key: str) -> None: ...

    async def release_free_heap(self) -> None:
        """Hand the process's free heap pages back to the OS (`marl.runtime.heap`) at a point where
        no generation step of this process runs: one that runs meanwhile faults back in
        the pages it is reusing."""
        ...

    async def close(self) -> None: ...


MAX_TEMPERATURE = 100.0
"""Above this, sampling is uniform noise for any model: a typo, not a setting."""
MAX_STOP_TOKEN_IDS = 256
MAX_SEED = (1 << 63) - 1
MAX_TOKENS = 1 << 20
"""Past this a max_tokens is a mistake; below it, decoding stops at the context's end anyway
(`room`), so no request holds the engine longer than a full context's decode."""


def room(request: GenerationRequest, limits: ModelLimits) -> int:
    """Tokens the context leaves after the prompt: the most a request may generate."""
    return limits.context - len(request.prompt_token_ids)


def check_request(request: GenerationRequest, limits: ModelLimits) -> None:
    """A ValueError naming the field for a request the engine must not see.

    Checked before a request joins a batch, so a bad one fails alone, and bounded so
    that no request can hold the engine longer than a full context's decode.
    """
    import math

    ids = request.prompt_token_ids
    if not ids:
        raise ValueError("prompt_token_ids is empty")
    vocab = limits.vocab_size
    if vocab:
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids[{bad}]: {ids[bad]} is outside the model's "
                             f"vocabulary 0..{vocab - 1}")
    if len(ids) >= limits.context:
        raise ValueError(f"prompt_token_ids: {len(ids)} tokens leave no room in the model's "
                         f"context of {limits.context}; shorten the prompt")
    if not 1 <= request.max_tokens <= MAX_TOKENS:
        raise ValueError(f"sampling.max_tokens: must be in 1..{MAX_TOKENS}, got "
                         f"{request.max_tokens}")
    t = request.temperature
    if not (math.isfinite(t) and 0 <= t <= MAX_TEMPERATURE):
        raise ValueError(f"sampling.temperature: must be a finite number in 0..{MAX_TEMPERATURE:g}"
                         f" (0 = greedy), got {t!r}")
    p = request.top_p
    if not (math.isfinite(p) and 0 <= p <= 1):
        raise ValueError(f"sampling.top_p: must be a finite number in 0..1 (0 or 1 = off), "
                         f"got {p!r}")
    if request.seed is not None and not 0 <= request.seed <= MAX_SEED:
        raise ValueError(f"sampling.seed: must be in 0..{MAX_SEED} (0 = unseeded), "
                         f"got {request.seed}")
    stops = request.stop_token_ids
    if len(stops) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"sampling.stop_token_ids: at most {MAX_STOP_TOKEN_IDS}, got {len(stops)}")
    if vocab:
        bad = next((i for i, t in enumerate(stops) if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"sampling.stop_token_ids[{bad}]: {stops[bad]} is outside the "
                             f"model's vocabulary 0..{vocab - 1}")
