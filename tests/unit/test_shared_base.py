"""One frozen base per learner process: concurrent runs' policies share its tensors, each
with adapters, AdamW state and draws of its own (services/learner/base_models.py)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from services.learner import base_models
from services.learner.policy import MultiAdapterPolicy
from tests.support.batches import new_policy, spec, step, voting_batch

ROOT = Path(__file__).resolve().parents[2]


def base_params(policy: MultiAdapterPolicy) -> dict[str, torch.Tensor]:
    return {n: p for n, p in policy.model.named_parameters() if "lora_" not in n}


def adapters(policy: MultiAdapterPolicy) -> dict[str, torch.Tensor]:
    return {p: torch.cat([t.detach().flatten() for t in policy.parameters(p)]).clone()
            for p in policy.policies}


def test_two_policies_of_one_process_share_the_base_and_train_apart(model_dir: Path) -> None:
    s = spec(mini_batch_size=2)
    a = new_policy(model_dir, "isolated", s)
    b = new_policy(model_dir, "isolated", s)
    base_a, base_b = base_params(a), base_params(b)
    assert base_a.keys() == base_b.keys() and base_a
    assert all(base_a[n].data_ptr() == base_b[n].data_ptr() for n in base_a)
    assert all(not p.requires_grad for p in base_a.values())
    lora_a = {n: p for n, p in a.model.named_parameters() if "lora_" in n}
    lora_b = {n: p for n, p in b.model.named_parameters() if "lora_" in n}
    assert all(lora_a[n].data_ptr() != lora_b[n].data_ptr() for n in lora_a)
    assert base_models.loaded() == [a.shared_base.key]  # type: ignore[union-attr]

    frozen = {n: p.detach().clone() for n, p in base_a.items()}
    b_before = adapters(b)
    first = step(a, voting_batch(), "isolated", s)
    after_a = adapters(a)
    assert all(not torch.equal(after_a[p], b_before[p]) for p in a.policies)  # a trained
    assert all(torch.equal(adapters(b)[p], b_before[p]) for p in b.policies)
    assert all(torch.equal(p, frozen[n]) for n, p in base_params(a).items())
    assert not any(opt.state for opt in b.optimizers.values())  # b's AdamW untouched

    # b, the same seed, the same batch: what a drew and trained alone, bit for bit
    second = step(b, voting_batch(), "isolated", s)
    assert [m.loss for m in second.mini_batches] == [m.loss for m in first.mini_batches]
    assert all(torch.equal(adapters(b)[p], after_a[p]) for p in b.policies)


def test_the_base_is_released_with_its_last_policy(model_dir: Path) -> None:
    s = spec()
    a = new_policy(model_dir, "shared", s)
    b = new_policy(model_dir, "shared", s)
    key = a.shared_base.key  # type: ignore[union-attr]
    del a
    gc.collect()
    assert key in base_models.loaded()  # b still trains on it
    del b
    gc.collect()
    assert key not in base_models.loaded()


def test_another_dtype_is_another_base(model_dir: Path) -> None:
    s = spec()
    a = MultiAdapterPolicy(str(model_dir), ["shared"], s.lora, s.optim, 10)
    b = MultiAdapterPolicy(str(model_dir), ["shared"], s.lora, s.optim, 10, dtype="float64")
    assert a.shared_base is not b.shared_base
    assert {n: p.dtype for n, p in base_params(b).items()} == {
        n: torch.float64 for n in base_params(b)}


MEMORY_SCRIPT = """
import gc, json
from pathlib import Path
import torch
from tests.support.batches import spec, step, voting_batch
from marl.runtime import heap
from services.learner.ranks import PolicyArgs

def rss():
    gc.collect()
    heap.release_free_heap()
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

s = spec(mini_batch_size=2)
args = PolicyArgs({model!r}, ["shared"], s.lora, s.optim, 10, "float32", 1, "cpu")
runs, sizes = [], []
for _ in range(4):
    runs.append(args.build("cpu"))  # a run's policy in the learner server's process
    step(runs[-1], voting_batch(), "shared", s)
    sizes.append(rss())
base = sum(p.numel() * p.element_size() for n, p in runs[0].model.named_parameters()
           if "lora_" not in n)
def ptrs(rs):
    return {{p.data_ptr() for r in rs for n, p in r.model.named_parameters() if "lora_" not in n}}
print(json.dumps({{"rss": sizes, "base_bytes": base, "base_tensors": len(ptrs(runs)),
                  "one_run_tensors": len(ptrs(runs[:1]))}}))
"""


def wide_model(out: Path) -> Path:
    """A Qwen3 from a config whose ~55 MB of float32 weights dominate a policy's memory."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from marl.models.demo import build_tokenizer

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
        max_position_embeddings=512,
    )
    Qwen3ForCausalLM(config).save_pretrained(out)
    build_tokenizer(["What is"]).save_pretrained(out)
    return out


@pytest.mark.timeout(600)
def test_four_concurrent_runs_hold_one_copy_of_the_base(tmp_path: Path) -> None:
    """In a fresh learner-like process, four runs' policies (each built and trained a step)
    take less resident memory beyond the first run's than one base model: one copy."""
    model = wide_model(tmp_path / "wide")
    script = MEMORY_SCRIPT.format(model=str(model))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT,
                         capture_output=True, text=True, timeout=560, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    base = got["base_bytes"]
    assert base > 40 * 2**20  # the test's premise: the base dominates
    grown = got["rss"][-1] - got["rss"][0]
    assert grown < base, (grown, got)
    assert got["base_tensors"] == got["one_run_tensors"]
