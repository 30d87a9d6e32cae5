"""Learner benchmark: what Isolated-Policy costs over Shared-Policy, and what the per-role
signals cost, on one Voting batch.

The batch is the demo's step (`marl demo`'s spec: 16 problems x 8 rollouts, each
3 generator turns + 1 aggregator turn = 512 role-turn sequences) with the real
Voting prompts rendered by the shipped demo model's chat template, answers in
the demo's shapes and rewards drawn 0/1 from a seed. The same batch trains the
shipped demo model's adapters under SP (one adapter, one stream of 512
sequences) and IP (generator 384, aggregator 128 sequences): with
`grpo.mini_batch_size` 128 both take 4 optimizer steps, so the ratio measures
the cost of keeping adapters apart, not of more updates.

Printed: median GRPO step time per policy over `--repeats` steps (after one
warm-up step each, alternating SP and IP so machine noise hits both), the ratio
IP / SP (goal <= 1.15) and the diagnostics' share of step time (`time/diagnostics_s`
over the step: the per-role gradient reads, π_old bookkeeping, the χ²/KL sample;
goal < 15 %). The last line is one JSON object with those figures.

    python bench/learner.py [--problems 16] [--group 8] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import torch

from marl.config import RunSpec, parse_spec
from marl.data import arithmetic
from marl.demo import DEMO_SPEC
from marl.demo_model import aggregator_example, demo_model_dir, solver_example
from marl.rollout import AdapterRef, Rollout, Turn
from marl.workflows import policy_of_role
from services.learner.policy import MultiAdapterPolicy
from services.learner.update import grpo_step


def encode(tokenizer: Any, messages: Any, answer: str) -> tuple[list[int], list[int]]:
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    p_ids = tokenizer.encode(str(prompt), add_special_tokens=False)
    a_ids = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    return p_ids, a_ids


def voting_batch(tokenizer: Any, problems: int, group: int, seed: int) -> list[Rollout]:
    """`problems` x `group` Voting rollouts: 3 generator turns and an aggregator turn each."""
    rng = random.Random(seed)
    train, _ = arithmetic.split(seed)
    out = []
    for problem in train[:problems]:
        for k in range(group):
            turns = []
            for slot in range(3):
                messages, answer = solver_example(problem, rng)
                p, c = encode(tokenizer, messages, answer)
                ref = AdapterRef("bench/generator", 0)
                turns.append(Turn("generator", slot, p, c, [-1.0] * len(c), "stop", ref, answer))
            messages, answer = aggregator_example(problem, rng)
            p, c = encode(tokenizer, messages, answer)
            ref = AdapterRef("bench/aggregator", 0)
            turns.append(Turn("aggregator", 0, p, c, [-1.0] * len(c), "stop", ref, answer))
            reward = float(rng.random() < 0.4)
            out.append(
                Rollout(f"{problem.id}:{k}", "bench", 0, "train", problem.id, k, turns, "", reward)
            )
    return out


def make_spec(policy: str, group: int) -> RunSpec:
    raw = json.loads(json.dumps(DEMO_SPEC))
    raw["policy"] = policy
    raw["grpo"]["group_size"] = group
    return parse_spec(raw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--problems", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    model = demo_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    rollouts = voting_batch(tokenizer, args.problems, args.group, args.seed)
    groups = [r.problem_id for r in rollouts]
    runs: dict[str, dict[str, Any]] = {}
    for mode in ("shared", "isolated"):
        spec = make_spec(mode, args.group)
        roles = policy_of_role(spec)
        policy = MultiAdapterPolicy(
            str(model), sorted(set(roles.values())), spec.lora, spec.optim, 1000, seed=args.seed
        )
        runs[mode] = {"spec": spec, "roles": roles, "policy": policy, "step_s": [], "diag": []}

    def one(mode: str) -> tuple[float, dict[str, float]]:
        run = runs[mode]
        t0 = time.perf_counter()
        result = grpo_step(run["policy"], rollouts, groups, run["roles"], run["spec"])
        return time.perf_counter() - t0, result.metrics

    for mode in runs:  # warm-up: allocator, kernels, first-touch pages
        one(mode)
    metrics: dict[str, dict[str, float]] = {}
    for _ in range(args.repeats):
        for mode in ("shared", "isolated"):
            seconds, m = one(mode)
            runs[mode]["step_s"].append(seconds)
            runs[mode]["diag"].append(m["time/diagnostics_s"] / seconds)
            metrics[mode] = m

    seqs = int(metrics["shared"]["train/sequences"])
    print(
        f"one Voting batch: {args.problems} problems x {args.group} rollouts x 4 turns = "
        f"{seqs} sequences; mini_batch_size {runs['shared']['spec'].grpo.mini_batch_size}; "
        f"{args.threads} threads; median of {args.repeats} steps"
    )
    print(f"{'policy':<10} {'step s':>8} {'diag share':>11}  optimizer steps")
    figures: dict[str, float] = {}
    for mode in ("shared", "isolated"):
        run = runs[mode]
        step = statistics.median(run["step_s"])
        diag = statistics.median(run["diag"])
        opt_steps = {
            k.split("/")[1]: int(v)
            for k, v in metrics[mode].items()
            if k.endswith("/optimizer_steps")
        }
        print(f"{mode:<10} {step:>8.3f} {diag:>10.1%}  {opt_steps}")
        figures[f"{mode}_step_s"] = round(step, 4)
        figures[f"{mode}_diagnostics_share"] = round(diag, 4)
    ratio = figures["isolated_step_s"] / figures["shared_step_s"]
    diag_share = max(figures["shared_diagnostics_share"], figures["isolated_diagnostics_share"])
    print(f"IP / SP step time: {ratio:.3f} (goal <= 1.15)")
    print(f"diagnostics' share of step time (worse of the two): {diag_share:.1%} (goal < 15 %)")
    print(
        json.dumps(
            {
                "bench": "learner",
                "sequences": seqs,
                "ip_over_sp_step_time": round(ratio, 4),
                "diagnostics_share": round(diag_share, 4),
                **figures,
            }
        )
    )


if __name__ == "__main__":
    main()
