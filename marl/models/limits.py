"""What a generation request must fit, read from a model directory's config.json: used by
inference to refuse a request and by workflow workers to size prompts."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelLimits:
    """What a request must fit: the model's context window and vocabulary."""

    context: int
    vocab_size: int


def model_limits(model_path: str) -> ModelLimits:
    """The limits from the model directory's config.json (read once per replica)."""
    import json
    from pathlib import Path

    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(
            f"--model: {model_path[:200]} has no readable config.json ({e})"[:400]
        ) from None
    text = config.get("text_config") or {}
    context = config.get("max_position_embeddings") or text.get("max_position_embeddings")
    vocab = config.get("vocab_size") or text.get("vocab_size")
    return ModelLimits(int(context or 2048), int(vocab or 0))
