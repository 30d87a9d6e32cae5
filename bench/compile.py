"""Does torch.compile pay for the learner's update? Eager against compiled, one batch.

The batch is learner_vs_peft's Voting batch (`--problems` arithmetic problems x `--group`
rollouts, 3 generator turns and an aggregator turn each, the model's chat template), on
the shipped demo model or SmolLM2-135M-Instruct (`--model`). Two policies start from the
same seed: one eager, one trained with `grpo.torch_compile: true` (inductor, dynamic
shapes: a step's micro-batches change shape); the loss path around the decoder (blocked
log-probs, the clipped loss) is the same code in both. They take turns, one GRPO step
each, for `--steps` steps, so a host whose pace drifts weighs on both; the first step of
each is left out (the compiled one compiles there: its excess over the eager first step
is printed as the compile time).

Printed: both median step times, their ratio compiled/eager, the compile time, and how
far the two adapters are apart after their first step (the same maths: float rounding).
The last line is one JSON object.

    python bench/compile.py [--model demo|smollm2] [--problems 4] [--group 4] [--steps 4]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from host import describe, host
from learner_vs_peft import adapter_vector, run_spec, voting_batch
from models import bench_model
from snapshot import add_save_option, emit

from services.learner.policy import MultiAdapterPolicy
from services.learner.update import grpo_step

ROLES = {"generator": "shared", "aggregator": "shared"}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("demo", "smollm2"), default="demo")
    p.add_argument("--problems", type=int, default=4)
    p.add_argument("--group", type=int, default=4, help="rollouts per problem")
    p.add_argument("--max-answer-tokens", type=int, default=64)
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha 2x)")
    p.add_argument("--steps", type=int, default=4, help="steps of each; the first is left out")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    add_save_option(p)
    args = p.parse_args()
    if args.steps < 2:
        p.error("--steps: at least 2 (the first of each is left out)")
    return args


def main() -> None:
    from transformers import AutoTokenizer

    args = parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-compile-") as tmp:
        model_dir = bench_model(args.model, Path(tmp))
        spec = run_spec(args, model_dir)
        rollouts = voting_batch(AutoTokenizer.from_pretrained(model_dir), args)
        groups = [r.problem_id for r in rollouts]
        sides = {
            name: MultiAdapterPolicy(model_dir, ["shared"], spec.lora, spec.optim, 1000,
                                     spec.model.dtype, args.seed)
            for name in ("eager", "compiled")
        }
        specs = {"eager": spec, "compiled": spec.model_copy(
            update={"grpo": spec.grpo.model_copy(update={"torch_compile": True})})}
        times: dict[str, list[float]] = {name: [] for name in sides}
        after_first: dict[str, torch.Tensor] = {}
        for _ in range(args.steps):
            for name, policy in sides.items():
                t0 = time.perf_counter()
                grpo_step(policy, rollouts, groups, ROLES, specs[name])
                times[name].append(time.perf_counter() - t0)
                if name not in after_first:
                    after_first[name] = adapter_vector(policy.model)
    eager, fast = (statistics.median(times[n][1:]) for n in ("eager", "compiled"))
    figures: dict[str, Any] = {
        "model": args.model, "dtype": args.dtype, "threads": args.threads,
        "sequences": 4 * len(rollouts), "steps": args.steps,
        "eager_step_s": round(eager, 4), "compiled_step_s": round(fast, 4),
        "compiled_over_eager": round(fast / eager, 3),
        "compile_s": round(times["compiled"][0] - times["eager"][0], 1),
        "adapter_max_abs_diff_after_step": float(
            (after_first["eager"] - after_first["compiled"]).abs().max()
        ),
        "host": host(),
    }
    print(f"{args.model}, {figures['sequences']} Voting sequences, {args.dtype}, "
          f"{args.threads} threads; median of {args.steps - 1} steps each, taken in turns")
    print(f"eager {eager:.3f} s, compiled {fast:.3f} s: compiled/eager "
          f"{figures['compiled_over_eager']:.2f}; compiling took {figures['compile_s']:.0f} s; "
          f"adapters after a step {figures['adapter_max_abs_diff_after_step']:.1e} apart")
    print(describe(figures["host"]))
    emit(figures, args.save)


if __name__ == "__main__":
    main()
