"""The small run spec every cluster test submits, so a test states only what it changes."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

LORA = {"rank": 4, "alpha": 8}
"""The tests' adapter: small enough to train in seconds on the CPU."""

REPLACED = frozenset({"data"})
"""Sections a change replaces whole instead of merging key by key."""


def demo_model_dir() -> Path:
    """The shipped demo model (warm-started: its rewards vary within a group)."""
    from marl.models.demo import demo_model_dir as shipped

    return shipped()


def small_spec(
    name: str,
    out_dir: Path,
    model: Path | str | None = None,
    *,
    workflow: str = "voting",
    steps: int = 2,
    group: int = 4,
    problems: int = 2,
    rollouts_logged: int | None = None,
    step_timeout_s: float = 300,
    temperature: float = 1.5,
    max_tokens: int = 12,
    **changes: Any,
) -> dict[str, Any]:
    """A run of a few small steps on arithmetic, one mini-batch each: no validation after
    step 0, no checkpoints, every rollout logged unless `rollouts_logged` says otherwise; on the
    demo model unless `model` names another. Each of `changes` is a top-level key: a
    section (a dict) is merged into the one here key by key, `data` and any other value
    replace it."""
    spec: dict[str, Any] = {
        "name": name,
        "workflow": workflow,
        "out_dir": str(out_dir),
        "model": {"path": str(model if model is not None else demo_model_dir())},
        "lora": dict(LORA),
        "optim": {"lr": 1e-2, "warmup_steps": 0},
        "grpo": {"group_size": group, "mini_batch_size": problems},
        "train": {
            "steps": steps,
            "problems_per_step": problems,
            "val_interval": 1000,
            "val_problems": 2,
            "checkpoint_interval": 1000,
            "rollouts_logged": group * problems if rollouts_logged is None else rollouts_logged,
            "step_timeout_s": step_timeout_s,
        },
        "sampling": {"temperature": temperature, "max_tokens": max_tokens},
        "data": {"train": "arithmetic", "val": "arithmetic"},
    }
    for key, value in copy.deepcopy(changes).items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict) and key not in REPLACED:
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return spec
