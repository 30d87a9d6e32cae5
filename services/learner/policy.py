"""One frozen base model carrying one LoRA adapter per policy, each with its own AdamW.

Under Shared-Policy there is one adapter; under Isolated-Policy one per role
type. A forward runs one adapter at a time, so an adapter's gradient only ever
comes from the tokens of the roles it serves.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from peft import (
    PeftModel,
    get_peft_model_state_dict,
    set_peft_model_state_dict,
)
from torch.utils.checkpoint import checkpoint
from transformers import AutoTokenizer
from transformers.optimization import (
    _get_constant_schedule_with_warmup_lr_lambda,
    _get_cosine_schedule_with_warmup_lr_lambda,
)

from marl.models.causal_lm import load_causal_lm
from marl.models.devices import resolve_dtype
from marl.models.lora import lora_on_rows, rows_maskable, with_lora
from marl.runtime import heap
from marl.spec.run import LoraSpec, OptimSpec
from services.learner import base_models, fsdp
from services.learner.chunked_logprobs import head_logprobs
from services.learner.grpo import at_least_float32
from services.learner.prompt_rows import Rows, layout
from services.learner.sequences import Sequence
from services.learner.varlen import (
    VARLEN,
    Kernel,
    VarlenLayout,
    flash_kernel,
    varlen_rows,
    varlen_supported,
)

if TYPE_CHECKING:
    from services.learner.update import PendingDrift

LOGIT_CHUNK_BYTES = 128 * 2**20
"""fp32 logits per log-prob chunk (about 220 positions at Qwen3's 152k vocabulary)."""

CUSTOM_MASK_ATTENTION = ("sdpa", "eager")
"""Attention implementations that take a [B, 1, L, L] additive mask as given."""

COMPILED_GRAPHS = 64
"""Graphs dynamo may keep per compiled function (`set_compiled`)."""

R = TypeVar("R")
_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,  # reference steps in tests: reproducible on every CPU
}


def _chunk_logprobs(
    head: Callable[[torch.Tensor], torch.Tensor],
    h: torch.Tensor,
    y: torch.Tensor,
    t: float,
    entropy: bool,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    logp = torch.log_softmax(at_least_float32(head(h)) / t, dim=-1)
    lp = logp.gather(-1, y[:, None]).squeeze(-1)
    if not entropy:
        return lp, None
    if entropy_grad:  # an entropy bonus in the loss (grpo.entropy_coef)
        return lp, -(logp.exp() * logp).sum(-1)
    with torch.no_grad():
        return lp, -(logp.exp() * logp).sum(-1)


def lr_lambda(optim: OptimSpec, total_steps: int) -> Callable[[int], float]:
    """The learning rate's factor at training step s: transformers' linear warmup, then
    its cosine to 0 at `total_steps` (or constant). transformers' warmup trains its step 0
    at a rate of 0; marl's counts the step it trains, (s + 1) / warmup_steps, and starts
    the cosine at step warmup_steps all the same, so warmup step s is transformers' s + 1."""
    warmup = optim.warmup_steps
    factor: Callable[[int], float]
    if optim.schedule == "cosine" and total_steps > warmup:
        factor = partial(
            _get_cosine_schedule_with_warmup_lr_lambda,
            num_warmup_steps=warmup,
            num_training_steps=total_steps,
            num_cycles=0.5,
        )
    else:
        factor = partial(_get_constant_schedule_with_warmup_lr_lambda, num_warmup_steps=warmup)
    return partial(_counting_the_step, factor, warmup)


def _counting_the_step(factor: Callable[[int], float], warmup: int, step: int) -> float:
    return float(factor(step + 1 if step < warmup else step))


def fused_adamw(device: torch.device) -> bool | None:
    """AdamW's fused kernel where torch has one: one call per step over every LoRA tensor,
    where the default on the CPU loops over them in Python (hundreds of small tensors on
    a real model)."""
    return True if device.type in ("cpu", "cuda") else None


def _keep_threads() -> None:
    pass


class MultiAdapterPolicy:
    def __init__(
        self,
        model_path: str,
        policies: list[str],
        lora: LoraSpec,
        optim: OptimSpec,
        total_steps: int,
        dtype: str = "float32",
        seed: int = 0,
        device: str = "cpu",
    ):
        """`device`: where the model trains. When this process is one rank of an
        initialised torch.distributed group of more than one, the decoder layers are
        sharded over it (fsdp.shard) and every method here is collective: each rank must
        call it, in the same order."""
        self.policies = list(policies)
        self.device = torch.device(device)
        tok = AutoTokenizer.from_pretrained(model_path)
        self.pad_id = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
        self.rank, self.world_size = fsdp.rank_and_size()
        self.shared_base: base_models.SharedBase | None = None
        """The process's base this policy's model shares (held so it stays loaded)."""
        base = self._base(model_path, _DTYPES[resolve_dtype(dtype, str(self.device))])
        torch.manual_seed(seed)  # after the load: the LoRA init draws alike, loaded or shared
        self.model: PeftModel = with_lora(base, lora, self.policies[0])
        config = self.model.peft_config[self.policies[0]]
        for name in self.policies[1:]:
            self.model.add_adapter(name, config)
        for name, param in self.model.named_parameters():
            if "lora_" in name:  # fp32 over a low-precision base (PEFT does so too; kept explicit)
                param.data = at_least_float32(param.data)
        self.model.to(self.device)
        if self.world_size > 1:
            fsdp.shard(self.model)
        self._params: dict[str, list[torch.nn.Parameter]] = {}
        self._state_names: dict[str, dict[str, torch.Tensor]] = {}
        self.optim = optim
        self.total_steps = total_steps
        self.optimizers = {
            p: torch.optim.AdamW(
                self.parameters(p),
                lr=optim.policy_lr.get(p, optim.lr),
                betas=optim.betas,
                weight_decay=optim.weight_decay,
                fused=fused_adamw(self.device),
            )
            for p in self.policies
        }
        # one scheduler step per training step (the paper's warmup counts steps), whatever
        # the number of optimizer steps an adapter takes within it
        factor = lr_lambda(optim, total_steps)
        self.schedulers = {
            p: torch.optim.lr_scheduler.LambdaLR(opt, factor) for p, opt in self.optimizers.items()
        }
        self.updates = 0
        self.pending_drift: PendingDrift | None = None
        """The last step's signals, left to be measured after its push (update.py)."""
        self.logit_chunk_bytes = LOGIT_CHUNK_BYTES
        self._checkpointing = False
        self._compiled = False
        self._split = self._split_check()
        self._custom_masks = base.config._attn_implementation in CUSTOM_MASK_ATTENTION
        self._dense_attention: str = base.config._attn_implementation
        self.varlen_kernel: Kernel | None = None
        self.set_varlen(True)
        self.pace: Callable[[], None] = _keep_threads
        """Called before every forward, on the thread that runs it (threads.ThreadBurst.pace)."""

    def _base(self, model_path: str, dtype: torch.dtype) -> Any:
        """The frozen base to wrap: this process's shared one (base_models.py), or, when
        the model is to be sharded over a group, one of this policy's own (FSDP replaces
        its parameters with this run's shard)."""
        if self.world_size > 1:
            base = load_causal_lm(model_path, dtype)
            base.requires_grad_(False)
            return base
        self.shared_base = base_models.acquire(model_path, dtype, self.device)
        return self.shared_base.checkout()

    def call(self, fn: Callable[..., R], *args: Any) -> R:
        """`fn(self, *args)`: the policy is its own handle when it lives in this process
        (ranks.PolicyHandle)."""
        return fn(self, *args)

    def parameters(self, policy: str) -> list[torch.nn.Parameter]:
        """The adapter's LoRA parameters, found once: the walk over every module's
        parameters is a visible share of a small model's update when it runs on every call."""
        if policy not in self._params:
            tag = f".{policy}."
            params = [p for n, p in self.model.named_parameters() if "lora_" in n and tag in n]
            assert params, f"no parameters for adapter {policy}"
            self._params[policy] = params
        return self._params[policy]

    def activate(self, policy: str) -> None:
        self.model.set_adapter(policy)
        for p in self.parameters(policy):
            p.requires_grad_(True)

    def release_free_heap(self) -> None:
        """This process's free heap pages back to the OS (`marl.runtime.heap`); between updates."""
        heap.release_free_heap()

    def target_modules(self, policy: str) -> list[str]:
        config: Any = self.model.peft_config[policy]
        return sorted(config.target_modules)

    def state_dict(self, policy: str) -> dict[str, torch.Tensor]:
        """The adapter's whole weights on the CPU (gathered from every rank's shard)."""
        return {
            k: fsdp.full(v.detach()).cpu().clone() for k, v in self._adapter_state(policy).items()
        }

    def _adapter_state(self, policy: str) -> dict[str, torch.Tensor]:
        """PEFT's state-dict names of the adapter's weights -> its live parameters, matched
        once: PEFT builds the whole model's state dict to pick them out, every push. Under
        FSDP (sharded parameters), PEFT's every time."""
        if self.world_size > 1:
            return get_peft_model_state_dict(self.model, adapter_name=policy)  # type: ignore[no-any-return]
        if policy not in self._state_names:
            params = {p.data_ptr(): p for p in self.parameters(policy)}
            found = get_peft_model_state_dict(self.model, adapter_name=policy)
            if any(v.data_ptr() not in params for v in found.values()):
                return found  # type: ignore[no-any-return]  # not only its parameters
            self._state_names[policy] = {k: params[v.data_ptr()] for k, v in found.items()}
        return self._state_names[policy]

    def load_state_dict(self, policy: str, state: dict[str, torch.Tensor]) -> None:
        current = get_peft_model_state_dict(self.model, adapter_name=policy)
        placed = {k: fsdp.like(current[k], v) if k in current else v for k, v in state.items()}
        set_peft_model_state_dict(self.model, placed, adapter_name=policy)

    def optimizer_state(self, policy: str) -> dict[str, Any]:
        """The adapter's AdamW state, whole and on the CPU: the same on every world size."""
        state = self.optimizers[policy].state_dict()
        return {
            "state": {
                i: {k: fsdp.full(v).cpu() for k, v in per_param.items()}
                for i, per_param in state["state"].items()
            },
            "param_groups": state["param_groups"],
        }

    def load_optimizer_state(self, policy: str, state: dict[str, Any]) -> None:
        params = self.parameters(policy)
        placed = {
            i: {k: v if k == "step" else fsdp.like(params[int(i)], v) for k, v in per_param.items()}
            for i, per_param in state["state"].items()
        }
        self.optimizers[policy].load_state_dict({**state, "state": placed})

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device)
        )
        return out.logits[:, :-1]  # type: ignore[no-any-return]

    def _split_check(self) -> bool:
        """Whether the causal LM's logits are exactly its output embeddings applied to its
        decoder's last hidden state (Llama, Qwen, Mistral...; not models that soft-cap or
        scale logits): then logits are computed only where they are needed."""
        base: Any = self.model.get_base_model()
        try:
            decoder, head = base.get_decoder(), base.get_output_embeddings()
        except (AttributeError, NotImplementedError):
            return False
        if decoder is None or head is None:
            return False
        ids = torch.tensor([[self.pad_id, 1, 2, 3]], device=self.device) % int(
            base.config.vocab_size
        )
        mask = torch.ones_like(ids)
        with torch.no_grad():
            want = base(input_ids=ids, attention_mask=mask).logits
            h = decoder(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            return bool(torch.allclose(head(h), want, rtol=1e-4, atol=1e-5))

    @property
    def varlen(self) -> bool:
        """Whether micro-batches are laid out as varlen rows (`use_varlen`)."""
        return self.varlen_kernel is not None

    def set_varlen(self, on: bool) -> None:
        """`grpo.varlen_attention`: off, dense rows; on, the kernel in use, or
        FlashAttention's where `varlen_supported`. A compiled decoder (`set_compiled`,
        called first) keeps dense rows: dynamo would specialise on every layout's segment
        lengths, a graph per micro-batch."""
        if not on or self._compiled:
            self.use_varlen(None)
        elif self.varlen_kernel is None and varlen_supported(
            self.model.get_base_model(), self.device
        ):
            self.use_varlen(flash_kernel)

    def use_varlen(self, kernel: Kernel | None) -> None:
        """Lay micro-batches out as varlen rows, attention by `kernel` (varlen.py); None:
        dense rows (prompt_rows.layout), with the attention the model was loaded with."""
        if (kernel is None) != (self.varlen_kernel is None):
            causal: Any = self.model.get_base_model()
            causal.set_attn_implementation(VARLEN if kernel is not None else self._dense_attention)
        self.varlen_kernel = kernel

    def features(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        base: bool = False,
        position_ids: torch.Tensor | None = None,
        varlen: VarlenLayout | None = None,
    ) -> torch.Tensor:
        """[B, L, D] per-position features that `head` turns into next-token logits: the
        decoder's last hidden state (D = hidden size), or, for a model whose logits are not
        its head applied to that state, the logits themselves (D = vocabulary). `base`:
        with every adapter disabled (the KL reference). `attention_mask` is [B, L] padding
        or a [B, 1, L, L] additive mask with `position_ids`, or None with `varlen`'s
        segments and `position_ids` (prompt_rows.Rows)."""
        if base:
            with self._adapters_off(input_ids.shape[0]):
                return self.features(input_ids, attention_mask, False, position_ids, varlen)
        self.pace()
        kwargs: dict[str, Any] = {"input_ids": input_ids.to(self.device)}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask.to(self.device)
        if position_ids is not None:
            kwargs["position_ids"] = position_ids.to(self.device)
        if varlen is not None:
            kwargs["varlen_layout"] = varlen
            kwargs["varlen_kernel"] = self.varlen_kernel
        if not self._split:
            return self.model(**kwargs).logits
        causal: Any = self.model.get_base_model()
        out = causal.get_decoder()(**kwargs, use_cache=False)
        return out.last_hidden_state  # type: ignore[no-any-return]

    def row_features(self, rows: Rows, base: bool = False) -> torch.Tensor:
        """[N, D] features at `rows`' predicting positions, in its sequence order."""
        feats = self.features(
            rows.input_ids, rows.attention_mask, base, rows.position_ids, rows.varlen
        )
        return feats[rows.rows, rows.cols]

    def row_features_with_base(self, rows: Rows) -> tuple[torch.Tensor, torch.Tensor]:
        """`row_features(rows)` and `row_features(rows, base=True)` from one forward of the
        rows twice over, the copy's LoRA terms scaled by 0 (lora.lora_on_rows), where every
        LoRA layer takes row scales; else from two forwards."""
        if not rows_maskable(self.model):
            return self.row_features(rows), self.row_features(rows, base=True)
        n = rows.input_ids.shape[0]

        def twice(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t, t])

        positions = None if rows.position_ids is None else twice(rows.position_ids)
        mask = None if rows.attention_mask is None else twice(rows.attention_mask)
        with lora_on_rows(self.model, torch.cat([torch.ones(n), torch.zeros(n)])):
            feats = self.features(twice(rows.input_ids), mask, False, positions, rows.varlen)
        return feats[rows.rows, rows.cols], feats[rows.rows + n, rows.cols]

    def _adapters_off(self, n_rows: int) -> AbstractContextManager[Any]:
        """Every adapter off for a forward of `n_rows` rows: row scales of 0 where every
        LoRA layer takes them (lora.lora_on_rows), else PEFT's `disable_adapter`."""
        if rows_maskable(self.model):
            return lora_on_rows(self.model, torch.zeros(n_rows))
        return self.model.disable_adapter()  # type: ignore[no-any-return]

    def row_layout(self, seqs: list[Sequence], row_tokens: int) -> Rows:
        """prompt_rows.layout for this model, or one varlen row (varlen.py) where the
        policy uses varlen attention; one sequence per row when its attention
        implementation takes no custom 4D mask (flash-attention)."""
        if self.varlen_kernel is not None:
            return varlen_rows(seqs, row_tokens)
        causal: Any = self.model.get_base_model()
        return layout(seqs, self.pad_id, row_tokens if self._custom_masks else 0, causal.dtype)

    def head(self, features: torch.Tensor) -> torch.Tensor:
        """Next-token logits of selected `features` rows, in the model's dtype."""
        if not self._split:
            return features
        causal: Any = self.model.get_base_model()
        return causal.get_output_embeddings()(features)  # type: ignore[no-any-return]

    def chunk_tokens(self) -> int:
        """Positions per log-prob chunk: their fp32 logits take about LOGIT_CHUNK_BYTES."""
        causal: Any = self.model.get_base_model()
        vocab = int(causal.config.vocab_size)
        return max(1, self.logit_chunk_bytes // (4 * vocab))

    def token_logprobs(
        self,
        features: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        entropy: bool = False,
        entropy_grad: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """log π(target) (and, if asked, the entropy, without gradient unless
        `entropy_grad`) at N selected positions: `features` [N, D], `targets` [N]. The
        same math as log_softmax(logits / T) over all N, with no more than
        `logit_chunk_bytes` of fp32 logits alive at once: blocked over positions and the
        vocabulary with a backward of its own (chunked_logprobs.py) when the head is a
        plain linear layer; else (features that are logits already, or a head an adapter
        wraps) a chunk of positions at a time, recomputed in the backward pass."""
        head = self._linear_head()
        if head is not None:
            return head_logprobs(
                features, head, targets, temperature, entropy=entropy,
                entropy_grad=entropy_grad, block_bytes=self.logit_chunk_bytes,
            )
        t = temperature if temperature > 0 else 1.0
        targets = targets.to(features.device)
        step = self.chunk_tokens()
        grad = torch.is_grad_enabled() and features.requires_grad
        logps, ents = [], []
        for start in range(0, features.shape[0], step):
            h, y = features[start : start + step], targets[start : start + step]
            if grad:
                lp, ent = checkpoint(
                    _chunk_logprobs, self.head, h, y, t,
                    entropy=entropy, entropy_grad=entropy_grad, use_reentrant=False,
                )
            else:
                lp, ent = _chunk_logprobs(self.head, h, y, t, entropy)
            logps.append(lp)
            if ent is not None:
                ents.append(ent)
        if not logps:
            empty = features.new_zeros(0, dtype=at_least_float32(features).dtype)
            return empty, (empty if entropy else None)
        return torch.cat(logps), (torch.cat(ents) if entropy else None)

    def _linear_head(self) -> torch.nn.Linear | None:
        """The output head when features are hidden states and it is a plain linear layer."""
        if not self._split:
            return None
        causal: Any = self.model.get_base_model()
        head = causal.get_output_embeddings()
        return head if type(head) is torch.nn.Linear else None

    def set_compiled(self, on: bool) -> None:
        """The decoder's forward through torch.compile, or back to eager
        (`grpo.torch_compile`). A step's forwards differ in what dynamo guards on (with and
        without gradients, position ids, one row or several), each a graph of its own:
        more than dynamo's default of 8 per function, hence COMPILED_GRAPHS."""
        if on == self._compiled:
            return
        causal: Any = self.model.get_base_model()
        decoder = causal.get_decoder()
        if on:
            dynamo: Any = torch._dynamo
            dynamo.config.cache_size_limit = max(dynamo.config.cache_size_limit, COMPILED_GRAPHS)
            decoder.forward = torch.compile(decoder.forward, dynamic=True)
        else:
            del decoder.forward  # the class's again
        self._compiled = on

    def set_activation_checkpointing(self, on: bool) -> None:
        """Recompute decoder layers in the backward pass (`grpo.activation_checkpointing`)."""
        if on == self._checkpointing:
            return
        base: Any = self.model.get_base_model()
        # transformers 5.2x names it activation_checkpointing_*, older ones gradient_*
        enable = getattr(base, "activation_checkpointing_enable", None)
        disable = getattr(base, "activation_checkpointing_disable", None)
        if on:
            kwargs = {"use_reentrant": False}
            if enable is not None:
                enable(activation_checkpointing_kwargs=kwargs)
            else:
                base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        elif disable is not None:
            disable()
        else:
            base.gradient_checkpointing_disable()
        self._checkpointing = on

    def base_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The frozen base model's logits (every adapter disabled): the KL reference."""
        with self._adapters_off(input_ids.shape[0]):
            return self.logits(input_ids, attention_mask)

    def lr(self, policy: str | None = None) -> float:
        """The learning rate `policy`'s adapter (default: the first) trains at this step."""
        return float(self.schedulers[policy or self.policies[0]].get_last_lr()[0])

    def end_step(self) -> None:
        """A training step is over: advance every adapter's schedule by one."""
        with warnings.catch_warnings():
            # an adapter that served no turn this step took no optimizer step; its schedule
            # still follows the training step
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
            for sched in self.schedulers.values():
                sched.step()
        self.updates += 1

    def copy_adapter(self, source: str, target: str) -> None:
        """Adaptive policy sharing's split (guard.py): adapter `target` (built beside the
        others, untrained) becomes a copy of `source` now, weights, AdamW state (moments and
        step count, learning rate) and schedule alike. Collective: call it through
        `PolicyHandle.call`."""
        self.load_state_dict(target, self.state_dict(source))
        self.load_optimizer_state(target, self.optimizer_state(source))
        self.schedulers[target].load_state_dict(self.schedulers[source].state_dict())

    def step(self, policy: str) -> float:
        """Clip this adapter's gradient, apply AdamW, zero it; returns the pre-clip norm."""
        norm = torch.nn.utils.clip_grad_norm_(
            self.parameters(policy), self.optim.grad_clip, foreach=True
        )
        self.optimizers[policy].step()
        self.optimizers[policy].zero_grad(set_to_none=True)
        return float(norm)
