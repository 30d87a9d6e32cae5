"""A base model's identity, compared between learner and inference before a push."""

from __future__ import annotations

import hashlib
from pathlib import Path


def base_model_id(path: str | Path) -> str:
    """`<directory name>:<sha256 of config.json, 12 hex>`; equal dirs give equal ids."""
    p = Path(path)
    config = p / "config.json"
    if not config.is_file():
        raise ValueError(
            f"field `model.path`: {str(p)!r} has no config.json; point it at a model dir"
        )
    digest = hashlib.sha256(config.read_bytes()).hexdigest()[:12]
    return f"{p.resolve().name}:{digest}"
