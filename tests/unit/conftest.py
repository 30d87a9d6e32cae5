"""Unit-test fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo architecture untrained (seed 0) with a two-word prompt vocabulary: small
    enough to build in a second, for tests of the learner's math on a real PEFT model."""
    from marl.models.demo import build_model, build_tokenizer

    out = tmp_path_factory.mktemp("tiny")
    tok = build_tokenizer(["What is"])
    build_model(tok, seed=0).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def small_vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3-shaped model with grouped-query attention and a 512-token vocabulary
    (tests.support.learner_step.tiny_model)."""
    from tests.support.learner_step import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tiny"), 512)


NUMERICS_SOURCES = ("import torch", "model_dir", "services.learner", "services.inference")
"""A unit-test module that names one of these computes with torch kernels, whose float32
results differ with the CPU's kernel set: `make test-kernels` runs these (`-m numerics`)
again under each lower set."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    sources: dict[Path, bool] = {}
    for item in items:
        path = item.path
        if path not in sources:
            text = path.read_text(encoding="utf-8")
            sources[path] = any(name in text for name in NUMERICS_SOURCES)
        if sources[path]:
            item.add_marker(pytest.mark.numerics)
