"""Varlen rows: the layout worked out by hand, and on a real (tiny Qwen3, grouped-query)
decoder the log-probs, entropies, gradients and GRPO step of dense rows, through the
per-segment kernel. FlashAttention's kernel against it where a GPU is present."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from marl.spec.run import parse_spec
from services.learner import policy as policy_module
from services.learner.policy import MultiAdapterPolicy
from services.learner.prompt_rows import pack_rows
from services.learner.update import completion_logprobs
from services.learner.varlen import (
    VARLEN,
    VarlenLayout,
    flash_kernel,
    segment_kernel,
    varlen_attention,
    varlen_rows,
    varlen_supported,
)
from tests.support.learner_step import one_turn as seq
from tests.support.learner_step import rollouts, run_step


def test_varlen_row_by_hand() -> None:
    seqs = [seq([5, 6], [7, 8]), seq([4], [9]), seq([5, 6], [9])]
    rows = varlen_rows(seqs, row_tokens=100)
    assert rows.input_ids.tolist() == [[5, 6, 7, 8, 9, 4, 9]]  # no padding
    assert rows.attention_mask is None
    assert rows.position_ids is not None
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 2, 0, 1]]
    layout = rows.varlen
    assert layout is not None and layout.width == 7
    # the shared prompt [5, 6]; 7 8 after it; 9 after it, not after 7 8; [4, 9] alone
    assert layout.cu_q == [0, 2, 4, 5, 7]
    assert layout.cu_k == [0, 2, 6, 9, 11]
    assert layout.keys == [0, 1, 0, 1, 2, 3, 0, 1, 4, 5, 6]
    assert (layout.max_q, layout.max_k) == (2, 4)
    # 7 and 8 predicted at columns 1 and 2, the lone 9 at 5, the shared prompt's 9 at 1
    assert rows.cols.tolist() == [1, 2, 5, 1]
    assert rows.rows.tolist() == [0, 0, 0, 0]
    assert rows.targets.tolist() == [7, 8, 9, 9]
    assert rows.lengths == [2, 1, 1]
    # no sharing: every sequence one segment of its own
    alone = varlen_rows(seqs, row_tokens=0).varlen
    assert alone is not None
    assert alone.cu_q == alone.cu_k == [0, 4, 6, 9]
    assert alone.keys == list(range(9))


def test_layout_tensors_for_the_row_twice_over() -> None:
    layout = VarlenLayout(width=3, cu_q=[0, 1, 3], cu_k=[0, 1, 4], keys=[0, 0, 1, 2])
    cu_q, cu_k, keys = layout.tensors(2, torch.device("cpu"))
    assert cu_q.dtype == cu_k.dtype == torch.int32
    assert cu_q.tolist() == [0, 1, 3, 4, 6]
    assert cu_k.tolist() == [0, 1, 4, 5, 8]
    assert keys.tolist() == [0, 0, 1, 2, 3, 3, 4, 5]
    assert layout.tensors(2, torch.device("cpu"))[0] is cu_q  # made once


def test_varlen_budget_counts_real_positions() -> None:
    # 2, 6 and 2 positions, no prompt shared: dense rows pad to the widest (2 x 6 > 10)
    seqs = [seq([1], [2]), seq([3], [4, 5, 6, 7, 8]), seq([9], [10])]
    assert pack_rows(seqs, [0, 1, 2], 8, 10, 0) == [[0], [1], [2]]
    assert pack_rows(seqs, [0, 1, 2], 8, 10, 0, varlen=True) == [[0, 1, 2]]
    assert pack_rows(seqs, [0, 1, 2], 8, 9, 0, varlen=True) == [[0, 1], [2]]
    # a shared prompt counts once: [1] + [2, 3] + [2, 3] + [2, 3] is 7 positions
    shared = [seq([1], [2, 3]) for _ in range(3)]
    assert pack_rows(shared, [0, 1, 2], 8, 7, 100, varlen=True) == [[0, 1, 2]]
    assert pack_rows(shared, [0, 1, 2], 8, 6, 100, varlen=True) == [[0, 1], [2]]


def varlen_policy(model: Path) -> MultiAdapterPolicy:
    spec = parse_spec({"lora": {"rank": 4, "alpha": 8}})
    policy = MultiAdapterPolicy(str(model), ["shared"], spec.lora, spec.optim, 4)
    for p in policy.parameters("shared"):  # LoRA B starts at 0: give the adapter an effect
        torch.nn.init.normal_(p, std=0.2)
    return policy


@pytest.mark.parametrize("row_tokens", [0, 1024])
def test_varlen_rows_give_the_numbers_of_dense_rows(small_vocab: Path, row_tokens: int) -> None:
    """Shared prompts, prompts of other lengths and a sequence alone, through the
    per-segment kernel: the log-probs, entropies and adapter gradients of padded rows."""
    policy = varlen_policy(small_vocab)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (7, 4, 9)]
    seqs = [seq(prompts[k % 3], torch.randint(3, 512, (1 + k,), generator=g).tolist())
            for k in range(8)]
    seqs.append(seq(torch.randint(3, 512, (5,), generator=g).tolist(), [7, 8, 9]))

    def run() -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        policy.optimizers["shared"].zero_grad()
        lp, ent, lengths = completion_logprobs(policy, seqs, 0.7, entropy=True,
                                               row_tokens=row_tokens)
        assert lengths == [1, 2, 3, 4, 5, 6, 7, 8, 3] and ent is not None
        (lp * torch.linspace(-1, 1, len(lp))).sum().backward()
        return lp.detach(), ent, [p.grad.clone() for p in policy.parameters("shared")]  # type: ignore[union-attr]

    want_lp, want_ent, want_grad = run()
    policy.use_varlen(segment_kernel)
    assert policy.model.get_base_model().config._attn_implementation == VARLEN
    assert policy.row_layout(seqs, row_tokens).input_ids.shape[0] == 1
    got_lp, got_ent, got_grad = run()
    torch.testing.assert_close(got_lp, want_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_ent, want_ent, rtol=1e-5, atol=1e-5)
    for got, want in zip(got_grad, want_grad, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # the row twice over, the copy with every adapter off (the KL reference)
    rows = policy.row_layout(seqs, row_tokens)
    with torch.no_grad():
        feats, base = policy.row_features_with_base(rows)
        policy.use_varlen(None)
        dense = policy.row_layout(seqs, row_tokens)
        want_feats, want_base = policy.row_features_with_base(dense)
    torch.testing.assert_close(feats, want_feats, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(base, want_base, rtol=1e-5, atol=1e-5)


def test_the_model_without_a_layout_keeps_its_padding_mask(small_vocab: Path) -> None:
    """A forward that passes no layout (any caller but the row builder) runs SDPA with
    the padding mask transformers builds: padded rows give their unpadded numbers."""
    policy = varlen_policy(small_vocab)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    with torch.no_grad():
        want = policy.logits(ids, mask)
        policy.use_varlen(segment_kernel)
        got = policy.logits(ids, mask)
        alone = policy.logits(ids[1:, :2], mask[1:, :2])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1:, :1], alone, rtol=1e-5, atol=1e-5)


def test_a_grpo_step_on_varlen_rows_is_the_dense_step(
    small_vocab: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`grpo.varlen_attention` where the policy may use it (made so here, the per-segment
    kernel standing in for FlashAttention's on the CPU): the dense step's losses, signals
    and adapter; False turns it off."""
    rs = rollouts(12, 6, 10, 500)
    for r in rs:  # the group's samples answer one prompt
        lead = rs[int(r.problem_id[1:]) * 4].turns[0]
        r.turns[0].prompt_ids = list(lead.prompt_ids)
    varlen_forwards: list[bool] = []
    row_features = MultiAdapterPolicy.row_features

    def counting(self: MultiAdapterPolicy, rows: Any, base: bool = False) -> torch.Tensor:
        varlen_forwards.append(rows.varlen is not None and rows.input_ids.shape[0] == 1)
        return row_features(self, rows, base)

    def step(grpo: dict[str, object]) -> tuple[Any, dict[str, torch.Tensor], set[bool]]:
        varlen_forwards.clear()
        result, state = run_step(small_vocab, 12, grpo, rollouts_=rs)
        return result, state, set(varlen_forwards)

    monkeypatch.setattr(MultiAdapterPolicy, "row_features", counting)
    ref, ref_state, ref_kinds = step({})
    assert ref_kinds == {False}
    monkeypatch.setattr(policy_module, "varlen_supported", lambda model, device: True)
    monkeypatch.setattr(policy_module, "flash_kernel", segment_kernel)
    ref_off, _, off_kinds = step({"varlen_attention": False})
    assert off_kinds == {False}
    got, got_state, got_kinds = step({})
    assert got_kinds == {True}
    for key in ("policy/shared/loss", "policy/shared/grad_norm", "role/solver/entropy",
                "role/solver/training_ppl", "role/solver/kl_base"):
        assert got.metrics[key] == pytest.approx(ref.metrics[key], rel=1e-4, abs=1e-5), key
        assert ref_off.metrics[key] == ref.metrics[key], key
    assert got.metrics["role/solver/update_chi2"] == pytest.approx(
        ref.metrics["role/solver/update_chi2"], rel=1e-3, abs=1e-5
    )
    # as in test_prompt_rows: rounding moves a few near-zero-gradient entries, a wrong
    # mask most of them
    diff = torch.cat([(got_state[k] - v).abs().flatten() for k, v in ref_state.items()])
    assert (diff > 1e-3).float().mean().item() < 0.01, (diff > 1e-3).sum().item()
    assert diff.mean().item() < 1e-4, diff.mean().item()


def test_varlen_is_used_where_flash_attention_takes_the_model(small_vocab: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(small_vocab, dtype=torch.bfloat16)
    cuda = torch.device("cuda")
    assert varlen_supported(model, cuda)
    assert not varlen_supported(model, torch.device("cpu"))
    model.config.layer_types = ["sliding_attention", "full_attention"]
    assert not varlen_supported(model, cuda)
    model.config.layer_types = ["full_attention", "full_attention"]
    model.config.model_type = "gemma2"  # soft-capped attention logits
    assert not varlen_supported(model, cuda)
    model.config.model_type = "qwen3"
    assert not varlen_supported(model.float(), cuda)  # FlashAttention: bf16 or fp16 only


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention's kernel needs CUDA")
def test_flash_kernel_is_the_segment_kernel_on_a_gpu() -> None:
    seqs = [seq([1, 2, 3], [4, 5]), seq([6], [7, 8, 9]), seq([1, 2, 3], [10])]
    layout = varlen_rows(seqs, 100).varlen
    assert layout is not None
    g = torch.Generator(device="cuda").manual_seed(0)

    def draw(heads: int) -> torch.Tensor:
        x = torch.randn(2, heads, layout.width, 64, generator=g, device="cuda")
        return x.to(torch.bfloat16).requires_grad_()

    q, k, v = draw(4), draw(2), draw(2)
    module = torch.nn.Module()
    out = {}
    for name, kernel in (("flash", flash_kernel), ("segment", segment_kernel)):
        o, _ = varlen_attention(module, q, k, v, None, 0.125, varlen_layout=layout,
                                varlen_kernel=kernel)
        o.float().square().sum().backward()
        out[name] = (o.detach().float(), *(t.grad.float() for t in (q, k, v)))  # type: ignore[union-attr]
        for t in (q, k, v):
            t.grad = None
    for got, want in zip(out["flash"], out["segment"], strict=True):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_varlen_follows_the_spec_and_stays_off_under_compile(
    small_vocab: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(policy_module, "varlen_supported", lambda model, device: True)
    monkeypatch.setattr(policy_module, "flash_kernel", segment_kernel)
    policy = varlen_policy(small_vocab)
    assert policy.varlen  # chosen where supported
    policy.set_varlen(False)
    assert not policy.varlen
    assert policy.model.get_base_model().config._attn_implementation == "sdpa"
    policy.set_varlen(True)
    assert policy.varlen_kernel is segment_kernel
    policy.set_compiled(True)  # a graph per layout: dense rows
    policy.set_varlen(True)
    assert not policy.varlen
    policy.set_compiled(False)
