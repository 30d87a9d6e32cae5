"""Shared fixtures: a tiny Qwen3 built from a config with the offline word-level tokenizer."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from tests.support.cluster import cluster, clusters, endpoints, module_clusters

__all__ = ["cluster", "clusters", "endpoints", "module_clusters"]  # fixtures every test may take

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _unfreeze_objects() -> Iterator[None]:
    """A test that runs a service's loop in this process freezes the objects alive then
    (`marl.runtime.gc_pauses`); the next test's garbage is collected as it would be on its own."""
    yield
    gc.unfreeze()


TEST_MODELS = Path(__file__).resolve().parents[1] / ".cache" / "test-models"
"""Built models are kept here (gitignored) between test runs, keyed by what shapes them:
a suite run on a loaded machine then skips the warm start after its first run."""


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen3 (head_dim 32) + word-level tokenizer, taught the `\\boxed{}` format in
    a few SFT steps so rewards vary within a group (answers mostly still wrong)."""
    import hashlib
    import inspect
    import shutil

    import marl.models.demo
    from marl.data import arithmetic
    from marl.models.demo import (
        PLAIN_ANSWER,
        aggregator_example,
        build_model,
        build_tokenizer,
        solver_example,
        warm_start,
    )
    from marl.workflows import prompts

    shaped_by = inspect.getsource(marl.models.demo) + inspect.getsource(tiny_model_dir)
    key = hashlib.sha256((shaped_by + prompts.ALL_TEMPLATE_TEXT).encode()).hexdigest()[:16]
    cached = TEST_MODELS / f"tiny-qwen3-{key}"
    if (cached / "model.safetensors").exists():
        return cached
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
    TEST_MODELS.mkdir(parents=True, exist_ok=True)
    staging = TEST_MODELS / f".{cached.name}.{os.getpid()}"
    shutil.copytree(out, staging, dirs_exist_ok=True)
    try:
        staging.rename(cached)  # atomic: a half-copied model is never taken for a built one
    except OSError:  # another run got there first
        shutil.rmtree(staging, ignore_errors=True)
    return out


@pytest.fixture()
def redis_url(tmp_path: Path):  # type: ignore[no-untyped-def]
    from marl.local.redis_server import PrivateRedis

    with PrivateRedis(workdir=str(tmp_path / "redis")) as server:
        yield server.url


@pytest.fixture()
def noscript_url(redis_url: str) -> str:
    """`redis_url` as a user whose ACL refuses scripts (EVAL), as some managed Redis
    services set it up."""
    import redis

    with redis.Redis.from_url(redis_url) as admin:
        admin.execute_command("ACL", "SETUSER", "noscript", "on", ">pw", "~*", "+@all", "-eval")
    return redis_url.replace("redis://", "redis://noscript:pw@")
