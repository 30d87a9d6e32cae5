"""The blocked log-probs and entropies equal log_softmax over the whole logits."""

from __future__ import annotations

import pytest
import torch

from services.learner.chunked_logprobs import block_shape, head_logprobs


def full(h: torch.Tensor, head: torch.nn.Linear, y: torch.Tensor, t: float) -> tuple[
        torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(head(h).float() / t, dim=-1)
    return logp.gather(-1, y[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def case(n: int, d: int, v: int, bias: bool, seed: int = 0) -> tuple[
        torch.Tensor, torch.nn.Linear, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(d, v, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, d, generator=g) * 0.5)
        if bias:
            head.bias.copy_(torch.randn(v, generator=g))
    h = torch.randn(n, d, generator=g)
    y = torch.randint(0, v, (n,), generator=g)
    return h, head, y


def test_block_shape_keeps_whole_vocabulary_rows_when_they_fit() -> None:
    assert block_shape(1000, 100, 4 * 100 * 300) == (300, 100)
    assert block_shape(10, 100, 4 * 100 * 300) == (10, 100)


def test_block_shape_splits_the_vocabulary_under_the_budget() -> None:
    rows, cols = block_shape(1000, 151_936, 64 * 2**20)
    assert rows == 256 and rows * cols * 4 <= 64 * 2**20 + rows * 4
    assert -(-151_936 // cols) == 3


@pytest.mark.parametrize("block_bytes", [4 * 7 * 13, 4 * 64 * 50, 2**30])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("t", [1.0, 0.7])
def test_values_and_gradients_equal_the_full_computation(
    block_bytes: int, bias: bool, t: float
) -> None:
    h, head, y = case(37, 16, 50, bias)
    h.requires_grad_(True)
    want_lp, want_ent = full(h, head, y, t)
    g_lp = torch.randn(37, generator=torch.Generator().manual_seed(1))
    g_ent = torch.randn(37, generator=torch.Generator().manual_seed(2))
    want = torch.autograd.grad((want_lp * g_lp).sum() + (want_ent * g_ent).sum(),
                               [h, *head.parameters()])
    lp, ent = head_logprobs(h, head, y, t, entropy=True, entropy_grad=True,
                            block_bytes=block_bytes)
    assert ent is not None
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, want_ent, rtol=0, atol=1e-5)
    got = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), [h, *head.parameters()])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_entropy_without_gradient_leaves_the_log_prob_gradient_alone() -> None:
    h, head, y = case(20, 8, 30, False)
    h.requires_grad_(True)
    head.requires_grad_(False)
    want_lp, want_ent = full(h, head, y, 1.0)
    (want,) = torch.autograd.grad(want_lp.sum(), [h])
    lp, ent = head_logprobs(h, head, y, 1.0, entropy=True, block_bytes=4 * 8 * 7)
    assert ent is not None and not ent.requires_grad
    torch.testing.assert_close(ent, want_ent, rtol=0, atol=1e-5)
    (got,) = torch.autograd.grad(lp.sum(), [h])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_float64_is_exact_to_float64_rounding() -> None:
    h, head, y = case(11, 8, 40, True)
    head = head.double()
    h = h.double().requires_grad_(True)
    logp = torch.log_softmax(head(h), dim=-1).gather(-1, y[:, None]).squeeze(-1)
    (want,) = torch.autograd.grad(logp.sum(), [h])
    lp, _ = head_logprobs(h, head, y, 1.0, block_bytes=8 * 3 * 9)
    assert lp.dtype == torch.float64
    torch.testing.assert_close(lp, logp, rtol=0, atol=1e-12)
    (got,) = torch.autograd.grad(lp.sum(), [h])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_no_positions_gives_empty_results() -> None:
    _, head, _ = case(1, 8, 30, False)
    lp, ent = head_logprobs(torch.zeros(0, 8), head, torch.zeros(0, dtype=torch.long), 1.0,
                            entropy=True)
    assert lp.shape == (0,) and ent is not None and ent.shape == (0,)
