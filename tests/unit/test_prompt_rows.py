"""Shared-prompt rows: the layout worked out by hand, and the same log-probs, entropies,
gradients and GRPO step as one sequence per row on a real (tiny Qwen3) decoder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from marl.spec.run import parse_spec
from services.learner.policy import MultiAdapterPolicy
from services.learner.prompt_rows import Rows, layout, pack_blocks, pack_rows, plan_rows
from services.learner.update import completion_logprobs
from tests.support.learner_step import one_turn as seq
from tests.support.learner_step import rollouts, run_step


def test_rows_group_equal_prompts_within_the_cap() -> None:
    seqs = [seq([5, 6], [7, 8]), seq([4], [9]), seq([5, 6], [9]), seq([5, 6], [3, 3, 3])]
    assert plan_rows(seqs, 100) == [[0, 2, 3], [1]]
    # [5, 6] + [7, 8] + [9] is 5 positions; [3, 3, 3] would make 8
    assert plan_rows(seqs, 6) == [[0, 2], [3], [1]]
    assert plan_rows(seqs, 0) == [[0], [1], [2], [3]]


def test_layout_by_hand() -> None:
    seqs = [seq([5, 6], [7, 8]), seq([4], [9]), seq([5, 6], [9])]
    rows = layout(seqs, pad_id=0, row_tokens=100, dtype=torch.float32)
    assert rows.input_ids.tolist() == [[5, 6, 7, 8, 9], [4, 9, 0, 0, 0]]
    assert rows.position_ids is not None
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 2], [0, 1, 0, 0, 0]]
    allowed = (rows.attention_mask == 0).squeeze(1).int().tolist()
    assert allowed[0] == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],  # 7 sees the prompt and itself
        [1, 1, 1, 1, 0],
        [1, 1, 0, 0, 1],  # 9 sees the prompt, not the other completion
    ]
    assert allowed[1] == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],  # padding sees itself only
        [0, 0, 0, 1, 0],
        [0, 0, 0, 0, 1],
    ]
    assert float(rows.attention_mask.min()) == torch.finfo(torch.float32).min
    # completion tokens in sequence order: 7 and 8 predicted at columns 1 and 2 of row 0,
    # 9 at column 0 of row 1, the second 9 at column 1 of row 0 (the prompt's last)
    assert rows.rows.tolist() == [0, 0, 1, 0]
    assert rows.cols.tolist() == [1, 2, 0, 1]
    assert rows.targets.tolist() == [7, 8, 9, 9]
    assert rows.lengths == [2, 1, 1]


def test_blocks_pack_first_fit_decreasing_within_the_widest() -> None:
    seqs = [seq([1] * 3, [2] * 3), seq([3], [4]), seq([5], [6, 6]), seq([7], [8] * 3)]
    # widths 6, 2, 3, 4: the rows hold 6 | 4 + 2 | 3, none wider than 6
    assert pack_blocks(seqs, [[0], [1], [2], [3]]) == [[[0]], [[3], [1]], [[2]]]
    assert pack_blocks(seqs, []) == []


def test_packed_layout_by_hand() -> None:
    """Two blocks of different prompts in one row: each sees only itself, positions from 0."""
    seqs = [seq([5, 6], [7, 8]), seq([4], [9]), seq([3], [2])]
    rows = layout(seqs, pad_id=0, row_tokens=100, dtype=torch.float32)
    assert rows.input_ids.tolist() == [[5, 6, 7, 8], [4, 9, 3, 2]]
    assert rows.position_ids is not None
    assert rows.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 0, 1]]
    allowed = (rows.attention_mask == 0).squeeze(1).int().tolist()
    assert allowed[1] == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [0, 0, 1, 0],  # the second block's prompt sees nothing of the first block
        [0, 0, 1, 1],
    ]
    assert rows.rows.tolist() == [0, 0, 1, 1]
    assert rows.cols.tolist() == [1, 2, 0, 2]
    assert rows.targets.tolist() == [7, 8, 9, 2]


def test_layout_without_shared_rows_is_the_padded_batch() -> None:
    seqs = [seq([5, 6], [7, 8]), seq([4], [9])]
    rows = layout(seqs, pad_id=0, row_tokens=100, dtype=torch.float32)
    assert rows.position_ids is None
    assert rows.input_ids.tolist() == [[5, 6, 7, 8], [4, 9, 0, 0]]
    assert rows.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert rows.cols.tolist() == [1, 2, 0]


def test_pack_counts_shared_rows_against_the_budget() -> None:
    seqs = [seq([5, 6], [7, 8]), seq([4], [9]), seq([5, 6], [9]), seq([5, 6], [3])]
    # sorted by prompt: [4] first, then the three [5, 6]; one row of 2 + 4 = 6 positions
    assert pack_rows(seqs, [0, 1, 2, 3], 8, 12, 100) == [[1, 2, 3, 0]]
    # a budget of 5: [4, 9] alone (2 rows x 3 are 6), then [5, 6, 9, 3] (4 positions);
    # [7, 8] would make that row 6 wide
    assert pack_rows(seqs, [0, 1, 2, 3], 8, 5, 100) == [[1], [2, 3], [0]]
    assert pack_rows(seqs, [0, 1, 2, 3], 2, 100, 100) == [[1, 2], [3, 0]]
    # no sharing: 4 sequences of up to 4 positions
    assert pack_rows(seqs, [0, 1, 2, 3], 8, 12, 0) == [[1, 2, 3], [0]]


def test_shared_rows_give_the_numbers_of_one_sequence_per_row(small_vocab: Path) -> None:
    spec = parse_spec({"lora": {"rank": 4, "alpha": 8}})
    policy = MultiAdapterPolicy(str(small_vocab), ["shared"], spec.lora, spec.optim, 4)
    for p in policy.parameters("shared"):  # LoRA B starts at 0: give the adapter an effect
        torch.nn.init.normal_(p, std=0.2)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (7, 4)]
    seqs = [seq(prompts[k % 2], torch.randint(3, 512, (2 + k,), generator=g).tolist())
            for k in range(6)]
    assert len(plan_rows(seqs, 1024)) == 2  # the test would prove nothing unshared
    assert policy.row_layout(seqs, 1024).position_ids is not None

    def run(row_tokens: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        policy.optimizers["shared"].zero_grad()
        lp, ent, lengths = completion_logprobs(policy, seqs, 0.7, entropy=True,
                                               row_tokens=row_tokens)
        assert lengths == [2, 3, 4, 5, 6, 7] and ent is not None
        (lp * torch.linspace(-1, 1, len(lp))).sum().backward()
        return lp.detach(), ent, [p.grad.clone() for p in policy.parameters("shared")]  # type: ignore[union-attr]

    want_lp, want_ent, want_grad = run(0)
    got_lp, got_ent, got_grad = run(1024)
    torch.testing.assert_close(got_lp, want_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_ent, want_ent, rtol=1e-5, atol=1e-5)
    for got, want in zip(got_grad, want_grad, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_packed_rows_give_the_numbers_of_one_sequence_per_row(small_vocab: Path) -> None:
    """Prompts of different lengths, none shared: packed side by side, the same log-probs,
    entropies and gradients as padded rows of one sequence each."""
    spec = parse_spec({"lora": {"rank": 4, "alpha": 8}})
    policy = MultiAdapterPolicy(str(small_vocab), ["shared"], spec.lora, spec.optim, 4)
    for p in policy.parameters("shared"):
        torch.nn.init.normal_(p, std=0.2)
    g = torch.Generator().manual_seed(1)
    seqs = [seq(torch.randint(3, 512, (n,), generator=g).tolist(),
                torch.randint(3, 512, (c,), generator=g).tolist())
            for n, c in ((12, 9), (3, 2), (5, 4), (2, 3), (6, 1), (4, 4))]
    blocks = plan_rows(seqs, 1024)
    assert len(pack_blocks(seqs, blocks)) < len(blocks)  # packing happens

    def run(row_tokens: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        policy.optimizers["shared"].zero_grad()
        lp, ent, _ = completion_logprobs(policy, seqs, 0.7, entropy=True, row_tokens=row_tokens)
        assert ent is not None
        (lp * torch.linspace(-1, 1, len(lp))).sum().backward()
        return lp.detach(), ent, [p.grad.clone() for p in policy.parameters("shared")]  # type: ignore[union-attr]

    want_lp, want_ent, want_grad = run(0)
    got_lp, got_ent, got_grad = run(1024)
    torch.testing.assert_close(got_lp, want_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_ent, want_ent, rtol=1e-5, atol=1e-5)
    for got, want in zip(got_grad, want_grad, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_grpo_step_with_shared_prompts_is_the_step_without(
    small_vocab: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Groups of 4 samples of one prompt each: the same losses, signals and adapter."""
    rs = rollouts(12, 6, 10, 500)
    for r in rs:  # the group's samples answer one prompt
        lead = rs[int(r.problem_id[1:]) * 4].turns[0]
        r.turns[0].prompt_ids = list(lead.prompt_ids)
    shared_forwards = []
    row_features = MultiAdapterPolicy.row_features

    def counting(self: MultiAdapterPolicy, rows: Rows, base: bool = False) -> torch.Tensor:
        shared_forwards.append(rows.position_ids is not None)
        return row_features(self, rows, base)

    monkeypatch.setattr(MultiAdapterPolicy, "row_features", counting)
    ref, ref_state = run_step(small_vocab, 12, {"shared_prompt_row_tokens": 0}, rollouts_=rs)
    assert not any(shared_forwards)
    got, got_state = run_step(small_vocab, 12, {}, rollouts_=rs)
    assert any(shared_forwards)
    # The loss is a mean of O(1) terms that cancel to ~1e-2 (advantages sum to zero), so its
    # float32 rounding is ~1e-6 absolute, and which way it goes depends on the BLAS kernels
    # the host's CPU gets (MKL_CBWR=COMPATIBLE passes at 1e-6, an AVX-512 EPYC does not).
    # A completion that sees another's tokens moves it by orders of magnitude more.
    # update_chi2 measures how far the step moved the policy, and so carries the AdamW
    # rounding below: 1.1e-4 relative apart under the default kernel set (5e-5 before the
    # blocked log-probs rounded differently), where a mask gone wrong moves it by far more.
    for key, rel in (("policy/shared/loss", 1e-4), ("policy/shared/grad_norm", 1e-4),
                     ("role/solver/entropy", 1e-4), ("role/solver/training_ppl", 1e-4),
                     ("role/solver/update_chi2", 1e-3), ("role/solver/kl_base", 1e-4)):
        assert got.metrics[key] == pytest.approx(ref.metrics[key], rel=rel, abs=1e-5), key
    # AdamW's first step at lr 0.1 moves an entry by ~lr * g / |g| whatever the gradient's
    # size, so an entry whose gradient is ~0 lands wherever the rounding puts it (one of
    # 8,192 by 1.2e-3 on one host). Masks or positions gone wrong move most entries by
    # ~0.1 (measured: ~6,000 entries off by over 1e-3, mean 0.07-0.08).
    diff = torch.cat([(got_state[k] - v).abs().flatten() for k, v in ref_state.items()])
    assert (diff > 1e-3).float().mean().item() < 0.01, (diff > 1e-3).sum().item()
    assert diff.mean().item() < 1e-4, diff.mean().item()
