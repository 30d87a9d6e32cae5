"""Choose an inference engine by name."""

from __future__ import annotations

from typing import Any

from marl.spec.run import EngineName
from services.inference.engine import Engine


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def make_engine(
    name: EngineName,
    model_path: str,
    dtype: str = "float32",
    max_lora_rank: int = 64,
    vllm_options: dict[str, Any] | None = None,
    device: str = "auto",
) -> Engine:
    """`vllm_options`: InferenceConfig.vllm_options(), read by the vLLM engine only;
    `device` (auto, cpu, cuda): read by the transformers engine only."""
    if name == "auto":
        name = "vllm" if vllm_available() else "transformers"
    if name == "vllm":
        if not vllm_available():
            raise ValueError(
                "engine=vllm: the vllm package is not installed in this environment; "
                "run scripts/setup_vllm_env.sh and start marl from .venv-vllm, or use engine=transformers"
            )
        from services.inference.vllm_engine import VLLMEngine

        return VLLMEngine(
            model_path, dtype=dtype, max_lora_rank=max_lora_rank, **(vllm_options or {})
        )
    from services.inference.transformers_engine import TransformersEngine

    return TransformersEngine(
        model_path, dtype=dtype, max_lora_rank=max(max_lora_rank, 256), device=device
    )
