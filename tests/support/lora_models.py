"""A tiny random Qwen3 and random LoRA adapters for it, in PEFT's state-dict form: what the
multi-adapter engine tests compare against PEFT's own forward."""

from __future__ import annotations

import copy

import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from transformers import Qwen3Config, Qwen3ForCausalLM

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_model() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.2,
    )
    return Qwen3ForCausalLM(config).eval()


def adapter(model: Qwen3ForCausalLM, rank: int, seed: int) -> dict[str, torch.Tensor]:
    peft = get_peft_model(copy.deepcopy(model), LoraConfig(r=rank, lora_alpha=16,
                                                             target_modules=TARGETS))
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen) * 0.2
            for k, v in get_peft_model_state_dict(peft).items()}
