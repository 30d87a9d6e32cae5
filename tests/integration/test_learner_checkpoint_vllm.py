"""vLLM loads a learner checkpoint's adapter directory as it is (LoRARequest on the folder)
and answers with the learner's own greedy tokens. Run by `make test-vllm` in .venv-vllm."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from marl.rollout import AdapterRef, Rollout, Turn
from marl.spec.run import parse_spec

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def _trained_checkpoint(model_dir: Path, out: Path) -> tuple[Path, list[int], list[int]]:
    from services.learner import checkpoint
    from services.learner.policy import MultiAdapterPolicy
    from services.learner.update import grpo_step

    spec = parse_spec(
        {
            "lora": {"rank": 8, "alpha": 16},
            "optim": {"lr": 0.05, "warmup_steps": 0},
            "sampling": {"temperature": 1.0},
            "grpo": {"group_size": 2, "mini_batch_size": 2},
        }
    )
    policy = MultiAdapterPolicy(str(model_dir), ["shared"], spec.lora, spec.optim, 10)
    rng = random.Random(0)
    rollouts = []
    for k, reward in enumerate([1.0, 0.0, 0.0, 1.0]):
        prompt = [rng.randrange(3, 40) for _ in range(5)]
        done = [rng.randrange(3, 40) for _ in range(4)]
        turn = Turn("solver", 0, prompt, done, [-1.0] * 4, "stop", AdapterRef("r/p", 0), "")
        rollouts.append(Rollout(f"t{k}", "r", 0, "train", f"p{k // 2}", k, [turn], "", reward))
    grpo_step(policy, rollouts, [r.problem_id for r in rollouts], {"solver": "shared"}, spec)
    ckpt = checkpoint.save(out, 1, policy, {"data_position": 0})
    prompt = [5, 9, 17, 23, 30, 11]
    policy.activate("shared")
    policy.model.eval()
    ids = list(prompt)
    with torch.no_grad():  # greedy, end-of-sequence or not (as ignore_eos below)
        for _ in range(8):
            ids.append(int(policy.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return checkpoint.adapter_dir(ckpt, "shared"), prompt, ids[len(prompt) :]


def test_vllm_loads_the_checkpoint_adapter_dir(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    pytest.importorskip("vllm", reason="vllm is not installed; run scripts/setup_vllm_env.sh")
    from marl.models.demo import build_model, build_tokenizer
    from services.inference.vllm_engine import _cpu_env_defaults

    model_dir = tmp_path_factory.mktemp("tiny")
    tok = build_tokenizer(["What is"])
    build_model(tok, seed=0).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    folder, prompt, want = _trained_checkpoint(model_dir, tmp_path_factory.mktemp("run"))

    _cpu_env_defaults()
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    llm = LLM(model=str(model_dir), enable_lora=True, max_loras=1, max_lora_rank=8,
              dtype="float32", max_model_len=128, generation_config="vllm")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = llm.generate(
        [{"prompt_token_ids": prompt}], params, lora_request=LoRARequest("ckpt", 1, str(folder))
    )
    assert list(out[0].outputs[0].token_ids) == want
