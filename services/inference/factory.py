"""Choose an inference engine by name."""

from __future__ import annotations

from marl.models.engines import resolve_engine, vllm_available
from marl.spec.services import InferenceConfig
from services.inference.engine import Engine


def make_engine(cfg: InferenceConfig) -> Engine:
    """The engine `cfg.engine` names (`auto`: vLLM when installed) for the model `cfg.model`.
    The vLLM settings are read by the vLLM engine only, `device` by the transformers one."""
    name = resolve_engine(cfg.engine)
    if name == "vllm":
        if not vllm_available():
            raise ValueError(
                "engine=vllm: the vllm package is not installed in this environment; "
                "run scripts/setup_vllm_env.sh and start marl from .venv-vllm, or use engine=transformers"
            )
        from services.inference.vllm_engine import VLLMEngine

        return VLLMEngine(cfg)
    from services.inference.transformers_engine import TransformersEngine

    return TransformersEngine(cfg)
