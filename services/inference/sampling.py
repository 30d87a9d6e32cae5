"""Next-token sampling for the transformers engine: one uniform per row, inverse CDF.

Each row's token comes from softmax(logits / temperature), cut to its top-p nucleus, by
inverse transform sampling: one uniform u per row picks the token whose interval of the
cumulative distribution holds u. Gumbel-max (the argmax of the log-probs plus noise), its
predecessor here, needs a uniform per vocabulary entry and two logarithms of each: with
128 rows of a 49,152-token vocabulary (SmolLM2's) that was a large share of a decode step
on 2 cores, more than the unseeded cost because a seeded row drew its noise from its own
`torch.Generator` (`bench/sampling.py` measures the two samplers). The cumulative sum is taken in two levels
(`_draw`): sums of blocks of `BLOCK` tokens locate u's block, and only that block is
summed token by token. That is cheaper than a cumulative sum along the whole vocabulary,
and more exact: a float32 one rounds every token's interval to the precision of the mass
before it (~1e-7), so tokens below that would get no interval or twice theirs.

A seeded row's uniform is `seeded_uniform(seed, index)`: the SplitMix64 output number
`index + 1` of a generator seeded with the row's seed, `index` being how many tokens the
row has sampled. The same seed therefore gives the same tokens whatever rows it shares a
batch with and whenever it joined, and a row carries no generator state. Unseeded rows
draw from torch's global generator.
"""

from __future__ import annotations

import torch

BLOCK = 256
"""Tokens per block of the two-level cumulative sum."""

_MASK64 = (1 << 64) - 1


def seeded_uniform(seed: int, index: int) -> float:
    """A uniform in [0, 1) with 53 random bits: SplitMix64's (index + 1)-th output for `seed`."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) * 2.0**-53


def row_uniforms(
    seeds: list[int | None], indices: list[int], device: torch.device | str = "cpu"
) -> torch.Tensor:
    """One float64 uniform per row: seeded rows' from (seed, index), the rest at random."""
    uniforms = torch.rand(len(seeds), dtype=torch.float64)
    seeded = [(i, s, n) for i, (s, n) in enumerate(zip(seeds, indices, strict=True))
              if s is not None]
    if seeded:
        values = [seeded_uniform(s, n) for _, s, n in seeded]
        uniforms[torch.tensor([i for i, _, _ in seeded])] = torch.tensor(values,
                                                                          dtype=torch.float64)
    return uniforms.to(device)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row sampling of (rows, vocab) logits: the token ids and their log-probs under the
    distribution sampled (the nucleus renormalized). A row with temperature <= 0 takes the
    argmax; top-p in (0, 1) keeps the fewest most likely tokens holding that mass."""
    rows, vocab = logits.shape
    logits = logits.float()
    greedy = temperature <= 0
    temperature = torch.where(greedy, torch.ones_like(temperature), temperature)
    top = logits.amax(-1, keepdim=True)
    weights = logits.new_zeros(rows, -(-vocab // BLOCK) * BLOCK)  # zero-weight padding
    torch.sub(logits, top, out=weights[:, :vocab])
    weights[:, :vocab].div_(temperature[:, None]).exp_()  # the most likely token's is 1
    tokens, total = _draw(weights, uniforms)
    nucleus = (top_p < 1).nonzero().squeeze(-1)
    if len(nucleus):  # in a batch of its own: a row samples alike in any batch
        tokens[nucleus], total[nucleus] = _nucleus(
            weights[nucleus], top_p[nucleus], uniforms[nucleus])
    tokens = tokens.clamp_max(vocab - 1)  # padding is drawn only from NaN weights
    if bool(greedy.any()):
        tokens = torch.where(greedy, logits.argmax(-1), tokens)
    chosen = logits.gather(-1, tokens[:, None]).squeeze(-1)
    logprobs = (chosen - top.squeeze(-1)) / temperature - total.log().float()
    return tokens, logprobs


def _nucleus(
    weights: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_draw` over each row's top-p nucleus, in order of decreasing probability."""
    ordered, order = weights.sort(stable=True, dim=-1, descending=True)
    mass = ordered.cumsum(-1, dtype=torch.float64)
    drop = (mass - ordered) >= top_p.double()[:, None] * mass[:, -1:]
    drop[:, 0] = False  # the most likely token, however small top-p (a float32 0)
    kept = ordered.masked_fill(drop, 0.0)
    positions, total = _draw(kept, uniforms)
    return order.gather(-1, positions[:, None]).squeeze(-1), total


def _draw(weights: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse transform sampling of (rows, k * BLOCK) non-negative weights: the index of
    each row's sample and the row's total weight (float64).

    The block is chosen by the blocks' float32 sums (each accurate to its own block's mass)
    and the token within it by a float64 cumulative sum of the block's weights, onto which
    the uniform's place in the block is rescaled: a token's probability is then off by
    the relative rounding of its block's sum, however small the token."""
    rows, width = weights.shape
    blocks = weights.view(rows, width // BLOCK, BLOCK)
    block_mass = blocks.sum(-1).double()
    block_cdf = block_mass.cumsum(-1)
    total = block_cdf[:, -1:]
    zero = torch.zeros_like(total)
    target = torch.minimum(uniforms.to(total)[:, None] * total, torch.nextafter(total, zero))
    # its cdf is > target; clamped for weights no distribution has (NaN from a broken model)
    block = torch.searchsorted(block_cdf, target, right=True).clamp_max(width // BLOCK - 1)
    start = block_cdf.gather(-1, (block - 1).clamp_min(0)).masked_fill(block == 0, 0.0)
    inner = blocks.gather(1, block[:, :, None].expand(rows, 1, BLOCK)).squeeze(1)
    inner_cdf = inner.cumsum(-1, dtype=torch.float64)
    inner_total = inner_cdf[:, -1:]
    rest = (target - start) / block_mass.gather(-1, block) * inner_total
    position = torch.searchsorted(
        inner_cdf, torch.minimum(rest, torch.nextafter(inner_total, zero)), right=True
    ).clamp_max(BLOCK - 1)
    return (block * BLOCK + position).squeeze(-1), total.squeeze(-1)
