"""The transformers engine's `device` setting: config field, resolution and placement."""

from __future__ import annotations

import asyncio
import threading
from unittest.mock import patch

import pytest
import torch

from marl.models.demo import demo_model_dir
from marl.models.devices import resolve_device
from marl.spec.services import InferenceConfig, load_service_config
from services.inference.engine import GenerationRequest, GenerationResult
from services.inference.running_batch import decode_all
from services.inference.transformers_engine import BASE, TransformersEngine


def test_device_field_defaults_to_auto_and_is_checked() -> None:
    assert load_service_config("inference", environ={}).device == "auto"
    cfg = load_service_config("inference", environ={"MARL_INFERENCE_DEVICE": "cpu"})
    assert cfg.device == "cpu"
    with pytest.raises(ValueError, match=r"^device: .*\(from MARL_INFERENCE_DEVICE\)"):
        load_service_config("inference", environ={"MARL_INFERENCE_DEVICE": "tpu"})


def test_auto_is_cuda_only_when_torch_sees_a_gpu() -> None:
    expected = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto", field="device") == expected
    assert resolve_device("cpu", field="device") == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_a_gpu_says_what_to_do() -> None:
    with pytest.raises(ValueError, match=r"device=cuda but torch sees no GPU.*use device=cpu"):
        resolve_device("cuda", field="device")


def test_engine_on_the_cpu_decodes_on_its_device() -> None:
    engine = TransformersEngine(InferenceConfig(model=str(demo_model_dir()), device="cpu"))
    assert next(engine.base.parameters()).device == torch.device("cpu")
    request = GenerationRequest([1, 2, 3], BASE, max_tokens=4, seed=7)
    first, again = (
        decode_all(engine.base, engine.lora, [request], [None], engine.eos_token_ids, 0)[0]
        for _ in range(2)
    )
    assert len(first.token_ids) == len(first.logprobs) <= 4
    assert first.token_ids == again.token_ids  # seeded rows stay reproducible


def test_heap_trim_runs_between_decode_steps_on_the_engine_thread() -> None:
    """A trim asked for while a request decodes runs on the engine's thread, which takes it
    between two decode steps, never beside one (where it would fault back in the pages the
    step reuses)."""
    engine = TransformersEngine(InferenceConfig(model=str(demo_model_dir()), device="cpu"))
    trims: list[str] = []

    def trim() -> bool:
        trims.append(threading.current_thread().name)
        return True

    async def go() -> tuple[list[str], GenerationResult]:
        decoding = asyncio.create_task(
            engine.generate(GenerationRequest([1, 2, 3], BASE, max_tokens=64, seed=7))
        )
        await asyncio.sleep(0.01)
        before = len(trims)
        await engine.release_free_heap()
        return trims[before:], await decoding

    with patch("services.inference.transformers_engine.release_free_heap", trim):
        asked, result = asyncio.run(go())
    assert 0 < len(result.token_ids) <= 64
    assert asked and all(name.startswith("engine") for name in asked), asked
