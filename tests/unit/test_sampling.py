"""The engine's sampler: inverse transform sampling from exact intervals, seeded uniforms."""

from __future__ import annotations

import math

import pytest
import torch

from services.inference.sampling import BLOCK, row_uniforms, sample, seeded_uniform


def draw(probs: list[float], uniforms: list[float], temperature: float = 1.0,
         top_p: float = 1.0) -> tuple[list[int], list[float]]:
    """Sample one row of log(probs) once per uniform."""
    n = len(uniforms)
    logits = torch.tensor([math.log(p) if p > 0 else -math.inf for p in probs]).repeat(n, 1)
    tokens, logprobs = sample(logits, torch.full((n,), temperature), torch.full((n,), top_p),
                              torch.tensor(uniforms, dtype=torch.float64))
    return tokens.tolist(), logprobs.tolist()


def test_seeded_uniforms_are_splitmix64_outputs() -> None:
    """SplitMix64's reference outputs for seed 1234567 (Vigna's splitmix64.c), top 53 bits."""
    reference = [6457827717110365317, 3203168211198807973, 9817491932198370423]
    assert [seeded_uniform(1234567, i) for i in range(3)] == [
        (x >> 11) * 2.0**-53 for x in reference
    ]
    assert seeded_uniform(1234567, 0) == pytest.approx(0.3500795420214081, abs=1e-16)


def test_row_uniforms_take_seeded_rows_from_seed_and_index_only() -> None:
    u = row_uniforms([7, None, 7, 9], [0, 0, 3, 0]).tolist()
    assert u[0] == seeded_uniform(7, 0) and u[2] == seeded_uniform(7, 3)
    assert u[3] == seeded_uniform(9, 0)
    assert 0.0 <= u[1] < 1.0
    assert len({u[0], u[2], u[3]}) == 3


def test_each_uniform_lands_in_its_tokens_interval_with_exact_log_probs() -> None:
    # cumulative 0.1, 0.3, 0.6, 1.0
    tokens, logprobs = draw([0.1, 0.2, 0.3, 0.4], [0.0, 0.09, 0.11, 0.29, 0.31, 0.59, 0.61, 0.9999])
    assert tokens == [0, 0, 1, 1, 2, 2, 3, 3]
    expected = [math.log(p) for p in (0.1, 0.1, 0.2, 0.2, 0.3, 0.3, 0.4, 0.4)]
    assert logprobs == pytest.approx(expected, abs=1e-6)


def test_blocks_of_zero_weight_are_skipped_and_the_last_token_is_reachable() -> None:
    vocab = 2 * BLOCK + 88  # three blocks, the last padded
    probs = [0.0] * vocab
    probs[5], probs[BLOCK + 44], probs[vocab - 1] = 0.25, 0.25, 0.5
    tokens, logprobs = draw(probs, [0.0, 0.2, 0.3, 0.6, 1.0 - 2.0**-53])
    assert tokens == [5, 5, BLOCK + 44, vocab - 1, vocab - 1]
    assert logprobs == pytest.approx([math.log(p) for p in (0.25, 0.25, 0.25, 0.5, 0.5)], abs=1e-6)


def test_tokens_far_below_float32_rounding_of_the_mass_before_them_keep_their_interval() -> None:
    """Past 1.0 a float32 cumulative sum holds multiples of 2**-23 (~1.2e-7): tokens of
    1e-7 would get intervals of 0 or 2**-23, token 4's none."""
    vocab = 1024
    probs = [1.0] + [1e-7] * (vocab - 1)
    total = 1.0 + (vocab - 1) * 1e-7
    uniforms = [(1.0 + 3.5e-7) / total, (1.0 + 699.5e-7) / total, 0.5]
    tokens, logprobs = draw(probs, uniforms)
    assert tokens == [4, 700, 0]
    assert logprobs == pytest.approx([math.log(1e-7 / total)] * 2 + [-math.log(total)], abs=1e-6)


def test_frequencies_follow_the_tempered_distribution() -> None:
    """Seeded draws, so the figures are fixed: a chi-square far inside its bounds."""
    gen = torch.Generator().manual_seed(0)
    vocab, n, temperature = 300, 60_000, 0.7
    logits = torch.randn(vocab, generator=gen) * 2
    logits[7] = -math.inf
    uniforms = row_uniforms(list(range(1, n + 1)), [0] * n)
    tokens, logprobs = sample(logits.repeat(n, 1), torch.full((n,), temperature),
                              torch.ones(n), uniforms)
    probs = torch.softmax(logits / temperature, -1).double()
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert counts[7] == 0
    seen = probs > 0
    chi2 = float((((counts - n * probs) ** 2)[seen] / (n * probs[seen])).sum())
    dof = int(seen.sum()) - 1
    assert chi2 < dof + 5 * math.sqrt(2 * dof), chi2
    assert logprobs.double() == pytest.approx(probs[tokens].log(), abs=1e-5)


def test_top_p_samples_the_renormalized_nucleus_and_top_p_one_keeps_all() -> None:
    # nucleus of 0.75: 0.4, 0.3, 0.2 (mass before each: 0, 0.4, 0.7); renormalized by 0.9
    tokens, logprobs = draw([0.1, 0.4, 0.2, 0.3], [0.3, 0.5, 0.8, 0.9999], top_p=0.75)
    assert tokens == [1, 3, 2, 2]
    expected = [math.log(p / 0.9) for p in (0.4, 0.3, 0.2, 0.2)]
    assert logprobs == pytest.approx(expected, abs=1e-6)
    n = 2
    logits = torch.tensor([[math.log(p) for p in (0.1, 0.4, 0.2, 0.3)]]).repeat(n, 1)
    mixed, logps = sample(logits, torch.ones(n), torch.tensor([0.75, 1.0]),
                          torch.tensor([0.9999, 0.9999], dtype=torch.float64))
    assert mixed.tolist() == [2, 3]  # the full distribution's last token is 0.3's
    assert logps.tolist() == pytest.approx([math.log(0.2 / 0.9), math.log(0.3)], abs=1e-6)
    assert draw([0.1, 0.4, 0.2, 0.3], [0.9999])[0] == [3]  # as in a batch with no top-p


def test_greedy_rows_take_the_argmax_beside_sampled_rows() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0], [0.0, 2.0, 1.0]])
    tokens, logprobs = sample(logits, torch.tensor([0.0, 1.0]), torch.ones(2),
                              torch.tensor([0.0, 0.0], dtype=torch.float64))
    assert tokens.tolist() == [1, 0]
    assert logprobs.tolist() == pytest.approx(torch.log_softmax(logits[0], -1)[[1, 0]].tolist())


def test_a_top_p_that_rounds_to_zero_keeps_the_most_likely_token() -> None:
    """gRPC carries top-p as a double: 5e-324 passes the server's (0, 1) check and is 0 in
    float32. The fuzzer found the nucleus left empty (an IndexError in the draw)."""
    tokens, logprobs = draw([0.1, 0.4, 0.2, 0.3], [0.0, 0.5, 0.9999], top_p=5e-324)
    assert tokens == [1, 1, 1] and logprobs == [0.0, 0.0, 0.0]


def test_logits_no_distribution_has_still_give_a_token_id_in_range() -> None:
    logits = torch.tensor([[float("nan")] * 300, [0.0] * 299 + [float("inf")]])
    for top_p in (1.0, 0.5):
        tokens, _ = sample(logits, torch.ones(2), torch.full((2,), top_p),
                           torch.tensor([0.3, 0.9], dtype=torch.float64))
        assert all(0 <= t < 300 for t in tokens.tolist())
