"""The Qwen3-0.6B one-GPU examples are valid run specs and inference settings, with the
paper's values where they leave a field alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from marl.spec.run import load_spec_file
from marl.spec.services import load_service_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "qwen3-0.6b"


@pytest.mark.parametrize("workflow", ["single", "voting", "eval_opt", "orch_workers"])
def test_each_workflow_spec_is_valid_with_the_papers_settings(workflow: str) -> None:
    spec = load_spec_file(EXAMPLES / f"{workflow}.yaml")
    assert spec.workflow == workflow
    assert (spec.lora.rank, spec.lora.alpha, spec.optim.lr, spec.grpo.group_size) == (
        64, 32.0, 2e-5, 8
    )
    assert (spec.train.problems_per_step, spec.train.steps, spec.grpo.mini_batch_size) == (
        64, 500, 64
    )
    assert spec.learner.device == "cuda" and spec.model.dtype == "bfloat16"
    assert spec.data.train == "dapo_math"


def test_inference_settings_load_and_reach_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_service_config("inference", str(EXAMPLES / "inference.yaml"), {})
    assert cfg.vllm_options()["gpu_memory_utilization"] == 0.45
    assert cfg.vllm_options()["max_model_len"] == 30720 + 5120
    monkeypatch.setenv("MARL_INFERENCE_GPU_MEMORY_UTILIZATION", "0.3")
    cfg = load_service_config("inference", str(EXAMPLES / "inference.yaml"), {})
    assert cfg.vllm_options()["gpu_memory_utilization"] == 0.3
    monkeypatch.setenv("MARL_INFERENCE_GPU_MEMORY_UTILIZATION", "1.5")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        load_service_config("inference", str(EXAMPLES / "inference.yaml"), {})
