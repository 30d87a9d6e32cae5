"""The per-role χ²/KL sample's cost: picked sequences cut after their last sampled token
against the same sample forwarded whole, on the shipped demo model.

Each GRPO step ends with two forwards (the updated adapter and the base model) over the
sequences holding `SAMPLE_TOKENS_PER_ROLE` uniformly sampled completion tokens per role
(`services/learner/diagnostics.py`). A causal model's distributions at those tokens do not
depend on what follows them, so each picked sequence is forwarded only up to its last
sampled token. Two batch shapes, 16 prompts x 8 completions each, every sequence of one
role: the demo's (a 40-token prompt, `--short` completion tokens) and long completions
(`--long`), where one or two tokens land in each picked sequence. Per shape, the median
wall time of `sampled_drift` over `--repeats` calls, whole and cut alternating, and the
ratio whole / cut; the metrics of both must agree. The last line is one JSON object.

    python bench/drift.py [--short 8] [--long 256] [--repeats 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from contextlib import nullcontext
from unittest.mock import patch

import torch
from learner import make_spec
from snapshot import add_save_option, emit

from marl.models.demo import demo_model_dir
from marl.runtime.heap import LEARNER_MMAP_THRESHOLD, keep_freed_heap_until_trimmed
from services.learner import diagnostics
from services.learner.diagnostics import RoleSignals, sample_tokens, sampled_drift
from services.learner.policy import MultiAdapterPolicy
from services.learner.sequences import Sequence

PROMPTS, GROUP, PROMPT_TOKENS = 16, 8, 40


def batch(completion: int, seed: int) -> list[Sequence]:
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(PROMPTS):
        prompt = torch.randint(0, 200, (PROMPT_TOKENS,), generator=g).tolist()
        for _ in range(GROUP):
            tokens = prompt + torch.randint(0, 200, (completion,), generator=g).tolist()
            seqs.append(
                Sequence("shared", "solver", tokens, PROMPT_TOKENS, 1.0, [0.0] * completion)
            )
    return seqs


def whole(seqs: list[Sequence], picked: dict[int, list[int]]) -> list[Sequence]:
    return list(seqs)


def measure(
    policy: MultiAdapterPolicy, completion: int, repeats: int, seed: int
) -> dict[str, float]:
    seqs = batch(completion, seed)
    old = [torch.zeros(completion) for _ in seqs]
    picked = sample_tokens(seqs, diagnostics.SAMPLE_TOKENS_PER_ROLE, random.Random(seed))
    spec = make_spec("shared", GROUP).grpo

    def once(cut: bool) -> tuple[float, dict[str, float]]:
        signals = RoleSignals()
        # the baseline: every picked sequence forwarded whole
        baseline = nullcontext() if cut else patch.object(diagnostics, "upto_last_picked", whole)
        with baseline:
            t0 = time.perf_counter()
            sampled_drift(
                policy,
                seqs,
                old,
                picked,
                1.0,
                spec.micro_batch_sequences,
                signals,
                spec.max_tokens_per_micro_batch,
                spec.row_tokens,
            )
            return time.perf_counter() - t0, signals.metrics()

    times: dict[str, list[float]] = {"whole": [], "cut": []}
    once(True)  # warm-up
    for _ in range(repeats):
        seconds, want = once(False)
        times["whole"].append(seconds)
        seconds, got = once(True)
        times["cut"].append(seconds)
        for key in ("role/solver/update_chi2", "role/solver/kl_base"):
            assert abs(got[key] - want[key]) <= 1e-4 * max(abs(want[key]), 1e-8), key
    whole_s, cut_s = (statistics.median(times[k]) for k in ("whole", "cut"))
    return {
        "completion_tokens": completion,
        "sequences_picked": len(picked),
        "whole_ms": whole_s * 1e3,
        "cut_ms": cut_s * 1e3,
        "whole_over_cut": whole_s / cut_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--short", type=int, default=8)
    ap.add_argument("--long", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    add_save_option(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_heap_until_trimmed(LEARNER_MMAP_THRESHOLD)  # as the learner's process
    spec = make_spec("shared", GROUP)
    policy = MultiAdapterPolicy(
        str(demo_model_dir()), ["shared"], spec.lora, spec.optim, 10, seed=args.seed
    )
    with torch.no_grad():
        for p in policy.parameters("shared"):
            p.normal_(0, 0.05)  # a trained-looking adapter: B starts at zero
    rows = [measure(policy, n, args.repeats, args.seed) for n in (args.short, args.long)]
    print(
        f"χ²/KL sample, {PROMPTS} prompts x {GROUP} completions, "
        f"{diagnostics.SAMPLE_TOKENS_PER_ROLE} tokens sampled, {args.threads} threads, "
        f"median of {args.repeats}"
    )
    print(
        f"{'completion tokens':>17} {'picked':>7} {'whole ms':>9} {'cut ms':>7} {'whole/cut':>10}"
    )
    for r in rows:
        print(
            f"{r['completion_tokens']:>17} {r['sequences_picked']:>7} {r['whole_ms']:>9.1f} "
            f"{r['cut_ms']:>7.1f} {r['whole_over_cut']:>9.2f}x"
        )
    emit({"bench": "drift", "threads": args.threads, "shapes": rows}, args.save)


if __name__ == "__main__":
    main()
