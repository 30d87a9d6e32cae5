"""The transformers engine's sampler against Gumbel-max, and its share of a decode step.

(a) `services.inference.sampling.sample` (one uniform per row, inverse CDF) against
    Gumbel-max sampling (a uniform per vocabulary entry; the engine's sampler before,
    kept here as the baseline, seeded rows drawing from their own `torch.Generator`),
    on `--rows` rows of random logits at temperature 1 for the demo model's, SmolLM2's
    and Qwen3's vocabularies, every row seeded (as a worker's turns are) and none;
    median of `--repeats` after a warm-up, alternating the two. Printed: ms per call
    and Gumbel / inverse CDF.
(b) One decode step of `--rows` seeded rows of a randomly initialised SmolLM2-135M
    architecture (30 layers, hidden 576, vocabulary 49152; nothing downloaded) through
    the engine's `RunningBatch`, with each sampler: ms per step and the ratio.

The last line is one JSON object with those figures.

    python bench/sampling.py [--rows 128] [--repeats 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from snapshot import add_save_option, emit

import services.inference.running_batch as running_batch
from services.inference.engine import GenerationRequest
from services.inference.running_batch import RunningBatch, make_row
from services.inference.sampling import row_uniforms, sample

VOCABS = {"demo": 219, "smollm2": 49152, "qwen3": 151936}


def gumbel_max(
    logits: torch.Tensor, temperature: torch.Tensor,
    generators: Sequence[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The baseline: argmax of the log-probs plus Gumbel noise, a uniform per entry."""
    logp = torch.log_softmax(logits.float() / temperature[:, None], dim=-1)
    uniform = torch.rand(logp.shape)
    for i, gen in enumerate(generators):
        if gen is not None:
            uniform[i] = torch.rand(logp.shape[-1], generator=gen)
    tokens = torch.argmax(logp - torch.log(-torch.log(uniform.clamp_min(1e-20))), dim=-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def median_ms(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Each fn's median time in ms, the fns alternating so machine drift hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1000)
    return {name: statistics.median(t) for name, t in times.items()}


def sampler_calls(rows: int, repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(0)
    ones = torch.ones(rows)  # temperature and top-p
    for name, vocab in VOCABS.items():
        logits = torch.randn(rows, vocab, generator=gen) * 3
        for seeded in (True, False):
            seeds: list[int | None] = [*range(1, rows + 1)] if seeded else [None] * rows

            def inverse_cdf(logits: torch.Tensor = logits,
                            seeds: list[int | None] = seeds) -> Any:
                return sample(logits, ones, ones, row_uniforms(seeds, [0] * rows))

            # made once, as the engine made a row's at admission
            generators = [torch.Generator().manual_seed(s) if s else None for s in seeds]

            def gumbel(logits: torch.Tensor = logits,
                       generators: list[torch.Generator | None] = generators) -> Any:
                return gumbel_max(logits, ones, generators)

            ms = median_ms({"inverse_cdf": inverse_cdf, "gumbel": gumbel}, repeats)
            out[f"{name}_{'seeded' if seeded else 'unseeded'}"] = {
                "vocab": vocab, **ms, "ratio": ms["gumbel"] / ms["inverse_cdf"]}
    return out


def decode_step(rows: int, repeats: int) -> dict[str, float]:
    """ms per decode step of a SmolLM2-shaped model with either sampler in the batch."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
        tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()

    def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                      uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # what the engine did per step: a generator per seeded row, seeded at admission
        return gumbel_max(logits, temperature, generators)

    generators = [torch.Generator().manual_seed(s) for s in range(1, rows + 1)]
    requests = [GenerationRequest(list(range(100 + i % 16, 160 + i % 16)), "", 10_000,
                                  temperature=1.0, seed=i + 1) for i in range(rows)]
    samplers = {"inverse_cdf": sample, "gumbel": gumbel_sample}
    batches = {}
    try:
        for name, fn in samplers.items():
            running_batch.sample = fn  # type: ignore[assignment]
            batches[name] = RunningBatch(model, None, 0)
            batches[name].admit([make_row(r, None, []) for r in requests])

        def one_step(name: str) -> Callable[[], Any]:
            def step() -> Any:
                running_batch.sample = samplers[name]  # type: ignore[assignment]
                return batches[name].step()
            return step

        ms = median_ms({name: one_step(name) for name in samplers}, repeats)
    finally:
        running_batch.sample = sample  # type: ignore[assignment]
    return {**ms, "ratio": ms["gumbel"] / ms["inverse_cdf"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    add_save_option(p)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    calls = sampler_calls(args.rows, args.repeats)
    print(f"sampler, {args.rows} rows at temperature 1 (ms per call, median of {args.repeats})")
    print(f"{'vocab':<18} {'inverse CDF':>12} {'Gumbel-max':>11} {'ratio':>7}")
    for name, f in calls.items():
        print(f"{name + ' ' + str(f['vocab']):<18} {f['inverse_cdf']:>12.2f} {f['gumbel']:>11.2f} "
              f"{f['ratio']:>6.2f}x")
    step = decode_step(args.rows, args.repeats)
    print(f"SmolLM2-shaped decode step, {args.rows} seeded rows: inverse CDF "
          f"{step['inverse_cdf']:.0f} ms, Gumbel-max {step['gumbel']:.0f} ms, "
          f"{step['ratio']:.2f}x")
    emit({"rows": args.rows, "threads": args.threads, "sampler": calls,
                      "decode_step": step}, args.save)


if __name__ == "__main__":
    main()
