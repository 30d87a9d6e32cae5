"""Loading a causal LM's frozen base: the learner's and the transformers engine's."""

from __future__ import annotations

from typing import Any

import torch


def load_causal_lm(model_path: str, dtype: torch.dtype) -> Any:
    """`AutoModelForCausalLM.from_pretrained` with transformers' Hub kernels off.

    Those kernels are code fetched from the Hugging Face Hub when a model loads; marl runs
    no code from the network and downloads nothing at run time. With them on, every
    `train()` and `eval()` also re-kernelizes the whole model, which a learner does twice a
    step."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, use_kernels=False)
