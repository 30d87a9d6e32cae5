"""Shared fixtures: a tiny Qwen3 built from a config with the offline word-level tokenizer."""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen3 (head_dim 32) + word-level tokenizer, taught the `\\boxed{}` format in
    a few SFT steps so rewards vary within a group (answers mostly still wrong)."""
    from marl.data import arithmetic
    from marl.demo_model import (
        PLAIN_ANSWER,
        aggregator_example,
        build_model,
        build_tokenizer,
        solver_example,
        warm_start,
    )
    from services.workflow import prompts

    out = tmp_path_factory.mktemp("tiny-qwen3")
    tok = build_tokenizer([prompts.ALL_TEMPLATE_TEXT, PLAIN_ANSWER, "What is"])
    model = build_model(tok, seed=0)
    train, _ = arithmetic.split(0)
    warm_start(
        model,
        tok,
        # always boxed: rewards then vary within a group (0 or 1), so every step
        # carries a GRPO signal; the demo's format lesson is not what these tests check
        [partial(solver_example, boxed_share=1.0), partial(aggregator_example, boxed_share=1.0)],
        train,
        seed=0,
        target_accuracy=0.1,
        max_steps=160,
        batch_size=32,
        log=lambda _: None,
    )
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture()
def redis_url(tmp_path: Path):  # type: ignore[no-untyped-def]
    from marl.redis_server import PrivateRedis

    with PrivateRedis(workdir=str(tmp_path / "redis")) as server:
        yield server.url
