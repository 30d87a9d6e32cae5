"""Which inference engine serves a model: `auto` is vLLM where it is installed.

The CLI, the launcher and the inference service all resolve `engine: auto` here, so
they agree on it. Only the package's presence is checked; vllm is not imported.
"""

from __future__ import annotations

import importlib.util


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def resolve_engine(name: str) -> str:
    """The engine `name` stands for: `auto` is `vllm` when vllm is installed and
    `transformers` otherwise; any other name is itself."""
    if name == "auto":
        return "vllm" if vllm_available() else "transformers"
    return name
