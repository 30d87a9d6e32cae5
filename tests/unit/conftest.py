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
