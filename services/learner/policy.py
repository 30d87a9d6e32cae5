"""One frozen base model carrying one LoRA adapter per policy, each with its own AdamW.

Under Shared-Policy there is one adapter; under Isolated-Policy one per role
type. A forward runs one adapter at a time, so an adapter's gradient only ever
comes from the tokens of the roles it serves.
"""

from __future__ import annotations

import math
import warnings
from functools import partial
from typing import Any

import torch
from peft import (
    LoraConfig,
    PeftModel,
    get_peft_model,
    get_peft_model_state_dict,
    set_peft_model_state_dict,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

from marl.config import LoraSpec, OptimSpec

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def lr_factor(step: int, warmup: int, total: int, schedule: str) -> float:
    """Linear warmup to 1, then cosine to 0 at `total` (or constant)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


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
    ):
        torch.manual_seed(seed)
        self.policies = list(policies)
        tok = AutoTokenizer.from_pretrained(model_path)
        self.pad_id = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=_DTYPES[dtype])
        base.requires_grad_(False)
        config = LoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,  # type: ignore[arg-type]  # PEFT accepts floats
            lora_dropout=lora.dropout,
            target_modules=lora.target_modules,
            bias="none",
        )
        self.model: PeftModel = get_peft_model(base, config, adapter_name=self.policies[0])
        for name in self.policies[1:]:
            self.model.add_adapter(name, config)
        self.optim = optim
        self.total_steps = total_steps
        self.optimizers = {
            p: torch.optim.AdamW(
                self.parameters(p),
                lr=optim.policy_lr.get(p, optim.lr),
                betas=optim.betas,
                weight_decay=optim.weight_decay,
            )
            for p in self.policies
        }
        # one scheduler step per training step (the paper's warmup counts steps), whatever
        # the number of optimizer steps an adapter takes within it
        factor = partial(
            lr_factor, warmup=optim.warmup_steps, total=total_steps, schedule=optim.schedule
        )
        self.schedulers = {
            p: torch.optim.lr_scheduler.LambdaLR(opt, factor) for p, opt in self.optimizers.items()
        }
        self.updates = 0

    def parameters(self, policy: str) -> list[torch.nn.Parameter]:
        tag = f".{policy}."
        params = [p for n, p in self.model.named_parameters() if "lora_" in n and tag in n]
        assert params, f"no parameters for adapter {policy}"
        return params

    def activate(self, policy: str) -> None:
        self.model.set_adapter(policy)
        for p in self.parameters(policy):
            p.requires_grad_(True)

    def target_modules(self, policy: str) -> list[str]:
        config: Any = self.model.peft_config[policy]
        return sorted(config.target_modules)

    def state_dict(self, policy: str) -> dict[str, torch.Tensor]:
        return {
            k: v.detach().clone()
            for k, v in get_peft_model_state_dict(self.model, adapter_name=policy).items()
        }

    def load_state_dict(self, policy: str, state: dict[str, torch.Tensor]) -> None:
        set_peft_model_state_dict(self.model, state, adapter_name=policy)

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]

    def base_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The frozen base model's logits (every adapter disabled): the KL reference."""
        with self.model.disable_adapter():
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

    def step(self, policy: str) -> float:
        """Clip this adapter's gradient, apply AdamW, zero it; returns the pre-clip norm."""
        norm = torch.nn.utils.clip_grad_norm_(self.parameters(policy), self.optim.grad_clip)
        self.optimizers[policy].step()
        self.optimizers[policy].zero_grad(set_to_none=True)
        return float(norm)
