"""Bounded learner memory: micro-batches packed to a token budget, logits only at completion
positions, made a chunk at a time in fp32; the same numbers as the full-vocabulary path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from marl.spec.run import parse_spec
from services.learner.grpo import token_entropy, token_logprobs
from services.learner.policy import MultiAdapterPolicy
from services.learner.prompt_rows import pack_rows
from services.learner.sequences import Sequence, collate
from services.learner.update import completion_logprobs
from tests.support.learner_step import run_step, tiny_model

ROOT = Path(__file__).resolve().parents[2]
QWEN3_VOCAB = 151936  # Qwen3's embedding rows: vocabulary-wide logits dominate memory


def test_pack_respects_both_limits() -> None:
    seqs = [Sequence("p", "r", [1] * n, 1, 0.0, []) for n in (2, 3, 3, 5, 9, 20)]
    assert pack_rows(seqs, list(range(6)), 8, 10, 0) == [[0, 1, 2], [3], [4], [5]]
    assert pack_rows(seqs, list(range(6)), 2, 100, 0) == [[0, 1], [2, 3], [4, 5]]
    assert pack_rows(seqs, [5, 0], 8, 10, 0) == [[0], [5]]  # longer than the budget: alone


def test_completion_logprobs_equal_full_vocabulary_path(small_vocab: Path) -> None:
    spec = parse_spec({"lora": {"rank": 4, "alpha": 8}})
    policy = MultiAdapterPolicy(str(small_vocab), ["shared"], spec.lora, spec.optim, 4)
    assert policy._split  # Qwen3: logits = lm_head(last hidden state)
    seqs = [Sequence("shared", "s", list(range(3, 3 + n)), p, 1.0, [])
            for n, p in ((9, 4), (6, 2), (12, 7))]
    b = collate(seqs, policy.pad_id)
    logits = policy.logits(b.input_ids, b.attention_mask)
    want_lp = token_logprobs(logits, b.targets, 0.7)[b.loss_mask.bool()]
    want_ent = token_entropy(logits, 0.7)[b.loss_mask.bool()]
    want_lp.sum().backward()
    want_grad = [p.grad.clone() for p in policy.parameters("shared")]  # type: ignore[union-attr]
    policy.optimizers["shared"].zero_grad()
    policy.logit_chunk_bytes = 4 * 512 * 3  # 3 positions per chunk, checkpointed
    got_lp, got_ent, lengths = completion_logprobs(policy, seqs, 0.7, entropy=True)
    assert lengths == [5, 4, 5]
    assert got_ent is not None
    torch.testing.assert_close(got_lp, want_lp, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_ent, want_ent, rtol=1e-5, atol=1e-6)
    got_lp.sum().backward()
    for p, w in zip(policy.parameters("shared"), want_grad, strict=True):
        torch.testing.assert_close(p.grad, w, rtol=1e-4, atol=1e-6)


def test_budget_chunks_and_checkpointing_change_no_number(small_vocab: Path) -> None:
    """One micro-batch of everything vs. tiny budgets, 1-position chunks and activation
    checkpointing: the same losses and the same updated adapter."""
    ref, ref_state = run_step(small_vocab, 12, {"micro_batch_sequences": 64,
                                                "max_tokens_per_micro_batch": 10**6})
    got, got_state = run_step(small_vocab, 12, {"max_tokens_per_micro_batch": 40,
                                                "activation_checkpointing": True},
                              chunk_bytes=4 * 512)
    for key in ("policy/shared/loss", "policy/shared/grad_norm", "role/solver/entropy",
                "role/solver/training_ppl", "role/solver/update_chi2", "role/solver/kl_base"):
        assert got.metrics[key] == pytest.approx(ref.metrics[key], rel=1e-4, abs=1e-6), key
    for k, v in ref_state.items():  # AdamW at lr 0.1 moves each entry by ~0.1
        torch.testing.assert_close(got_state[k], v, rtol=1e-3, atol=1e-4)


CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    torch.set_num_threads(1)
    from marl.runtime.heap import LEARNER_MMAP_THRESHOLD, keep_freed_heap_until_trimmed
    from tests.support.learner_step import run_step
    keep_freed_heap_until_trimmed(LEARNER_MMAP_THRESHOLD)  # as the learner's process does
    model, n, budget, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    result, _ = run_step(model, n, {"max_tokens_per_micro_batch": budget}, chunk)
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec from the forking parent (a
    # ~1 GB pytest process in the full suite), VmHWM belongs to this process's memory map
    hwm = next(int(line.split()[1]) for line in open("/proc/self/status")
               if line.startswith("VmHWM:"))
    print(json.dumps({"peak_kb": hwm, "loss": result.metrics["policy/shared/loss"]}))
    """
)


def peak_rss_kb(model: Path, n: int, budget: int, chunk_bytes: int) -> int:
    # the learner's heap setting maps blocks of 1 MiB and more on their own, so the
    # high-water mark is what was alive at once, not the heap's free holes
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(model), str(n), str(budget), str(chunk_bytes)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=180, check=True,
    )
    return int(json.loads(out.stdout.strip().splitlines()[-1])["peak_kb"])


@pytest.mark.slow
def test_peak_memory_flat_as_the_step_grows_8x(tmp_path: Path) -> None:
    """A Qwen3-vocabulary tiny model: a step of 4 and of 32 sequences peak within 10 % of
    each other at the same budget; with a budget and chunks as large as the step, the same
    32 sequences peak higher: the measurement sees vocabulary-wide logits, as the learner
    made them before (32 sequences x ~10 completion positions x 152k fp32 logits, ~190 MB).
    Measured with the learner's heap setting, whose kept free heap (up to the trim
    threshold) raises every peak alike: 633 MB at 32 sequences, 770 MB unbounded."""
    model = tiny_model(tmp_path / "m", QWEN3_VOCAB)
    chunk = 16 * 2**20  # ~27 positions of 152k fp32 logits
    small = peak_rss_kb(model, 4, 64, chunk)
    large = peak_rss_kb(model, 32, 64, chunk)
    unbounded = peak_rss_kb(model, 32, 10**6, 2**40)
    assert abs(large - small) <= 0.10 * small, (small, large)
    assert unbounded - large > 64 * 1024, (large, unbounded)
