"""A base model wrapped by PEFT with the RunSpec's LoRA: the learner's policy, the step-0
adapters of `marl episode`, and `marl eval`'s zero adapters all build it here."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from marl.config import LoraSpec

if TYPE_CHECKING:
    from peft import PeftModel


def with_lora(base: Any, lora: LoraSpec, adapter_name: str = "default") -> PeftModel:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # PEFT accepts floats
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        bias="none",
    )
    with warnings.catch_warnings():
        # PEFT reads transformers' deprecated `is_gradient_checkpointing` while wrapping:
        # not the user's to act on
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        return get_peft_model(base, config, adapter_name=adapter_name)
