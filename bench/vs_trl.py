"""Single-agent GRPO: marl's Single workflow against TRL's `GRPOTrainer`, same setup.

Both train the shipped demo model in float32 with a LoRA (rank `--rank`, alpha 2x) on the same
arithmetic problems, prompts (the generator's chat messages, through the tokenizer's
chat template) and reward (`marl.rewards.math_scoring.score`, format penalty included): `--problems`
problems a step, `--group` samples each, at most `--max-tokens` new tokens, temperature
1.0, one optimizer step per training step (the whole group batch is one mini-batch, and
one forward and backward: marl's micro-batch holds it all, as TRL's device batch does),
AdamW at a constant learning rate, PPO clip 0.2/0.28, no KL, group-normalised advantages,
sequence-mean token-mean loss, for `--steps` steps. marl runs on-policy as TRL does
(`train.max_staleness` 0) unless `--max-staleness` says otherwise; the header says which.

- TRL: `GRPOTrainer` in this process (transformers generation, peft LoRA), on the CPU;
- marl: every service its own process (learner, one inference replica on the
  transformers engine, `--workers` workflow workers, a private Redis), as `marl demo`.

TRL trains twice, before and after marl (the same seed, so the same run), and its steps
after `--warmup` of both runs make its median: a host whose pace drifts during the bench
weighs on both sides.

Printed: the median step time of each after `--warmup` steps (wall-clock, from one step's
end to the next's for TRL, from one step's start to the next's for marl, read from its
learner's trace: each includes what happens between two steps, a record written; only the
learner traces, as tracing is off in a run of marl's own, unless `--trace-all`), their
ratio marl/TRL (goal <= 0.6; the project's 0.5), and both reward curves, so that
neither wins by learning less. Needs TRL (`pip install trl==1.16.0`; it installs beside
marl's pins). Prints a table, then one JSON object as the very last line.

    python bench/vs_trl.py [--steps 12] [--problems 16] [--group 8] [--max-tokens 8]
                           [--max-staleness 0] [--learner-threads N] [--inference-threads N]
                           [--keep DIR] [--trace-all]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from e2e import run_marl
from e2e import spec as e2e_spec
from host import describe, host
from snapshot import add_save_option, emit

from marl.data import load_problems
from marl.local.launcher import DEFAULT_CORES, Cluster, service_threads
from marl.models.demo import demo_model_dir
from marl.monitor.trace_summary import load, step_times
from marl.rewards.math_scoring import score
from marl.spec.run import DataSpec
from marl.workflows import prompts

LR = 2e-3
PROMPT_TOKENS_BOUND = 64
"""More than any arithmetic prompt takes in the demo tokenizer's chat template."""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the median")
    p.add_argument("--problems", type=int, default=16, help="problems per step")
    p.add_argument("--group", type=int, default=8, help="samples per problem")
    p.add_argument("--max-tokens", type=int, default=8, help="response cap")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank")
    p.add_argument("--workers", type=int, default=1, help="marl workflow workers")
    p.add_argument(
        "--max-staleness",
        type=int,
        default=0,
        help="marl's train.max_staleness (0: on-policy, as TRL; 1: rollouts one step ahead)",
    )
    p.add_argument("--learner-threads", type=int, default=None,
                   help="marl learner's threads (default: as `marl demo` sets them on 2 cores)")
    p.add_argument("--trace-all", action="store_true",
                   help="every marl service traces, not the learner alone (with --keep: "
                   "where each step's time went, `marl trace DIR/trace`)")
    p.add_argument("--inference-threads", type=int, default=None,
                   help="marl inference's threads (default: as `marl demo` sets them on 2 cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", metavar="DIR", default=None,
                   help="run in DIR and keep it: marl's traces (`marl trace DIR/trace`), its "
                        "run directory and TRL's output")
    add_save_option(p)
    return p.parse_args()


def trl_settings(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """`GRPOConfig`'s arguments for marl's setup. TRL trains in bf16 autocast unless told
    otherwise; marl's learner trains the demo model in float32 (`model.dtype`), and on a
    CPU without native bf16 (AVX2 alone) a bf16 matmul of the demo's shapes takes ~58x
    an fp32 one, which made TRL's step ~9x slower on such a host: both train in fp32."""
    batch = args.problems * args.group
    return dict(
        output_dir=str(out),
        max_steps=args.steps,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_generations=args.group,
        generation_batch_size=batch,
        max_completion_length=args.max_tokens,
        temperature=1.0,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="grpo",
        scale_rewards="group",
        num_iterations=1,
        use_cpu=True,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=args.seed,
        disable_dropout=True,
        bf16=False,
        fp16=False,
    )


def run_trl(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    try:
        from datasets import Dataset
        from peft import LoraConfig
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as err:
        raise SystemExit(f"bench/vs_trl.py needs TRL: pip install trl==1.16.0 ({err})") from None

    problems = load_problems(DataSpec(train="arithmetic", val="arithmetic"), "train", args.seed)
    rows = [{"prompt": prompts.generator(p), "answer": p.answer, "question": p.prompt}
            for p in problems]

    def reward(completions: list[Any], answer: list[str], question: list[str],
               **_: Any) -> list[float | None]:
        return [score(c[0]["content"], a, question=q)
                for c, a, q in zip(completions, answer, question, strict=True)]

    ends: list[float] = []
    rewards: list[float] = []

    class Clock(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, *a: Any, **k: Any) -> None:
            ends.append(time.perf_counter())

        def on_log(self, *a: Any, logs: dict[str, float] | None = None, **k: Any) -> None:
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

    config = GRPOConfig(**trl_settings(args, out))
    trainer = GRPOTrainer(
        model=str(demo_model_dir()),
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_list(rows),
        peft_config=LoraConfig(
            r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear", lora_dropout=0.0
        ),
        callbacks=[Clock()],
    )
    start = time.perf_counter()
    trainer.train()
    steps = [b - a for a, b in zip([start, *ends[:-1]], ends, strict=True)]
    return {"step_s": steps, "reward": rewards}


def run_marl_single(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    out = root / "marl-run"
    spec = e2e_spec("single", out, args, staleness=args.max_staleness)  # e2e's demo run
    spec.update(name="vs-trl", seed=args.seed, engine="transformers")
    del spec["train"]["rollouts_logged"]  # e2e logs every rollout to count tokens; not needed
    spec["optim"] = {"lr": LR, "warmup_steps": 0, "schedule": "constant"}
    batch = args.problems * args.group
    spec["grpo"] = {
        "group_size": args.group,
        "mini_batch_size": args.problems,  # one optimizer step, as TRL's
        # and one forward and backward over the whole batch, as TRL's
        # per_device_train_batch_size
        "micro_batch_sequences": batch,
        "max_tokens_per_micro_batch": batch * (PROMPT_TOKENS_BOUND + args.max_tokens),
        "loss_agg": "seq_mean_token_mean",
    }
    threads = service_threads(DEFAULT_CORES, overlapped=args.max_staleness > 0)
    threads["learner"] = args.learner_threads or threads["learner"]
    threads["inference"] = args.inference_threads or threads["inference"]
    cluster = Cluster(
        root / "cluster",
        str(demo_model_dir()),
        engine="transformers",
        sandbox_replicas=0,
        workflow_replicas=args.workers,
        max_lora_rank=args.rank,
        threads=threads,
        trace_dir=root / "trace",
        # the learner's spans time its steps; the other services' cost them (a worker
        # writes two an episode) and only explain them
        traced=None if args.trace_all else ("learner",),
    )
    with cluster:
        run_marl(cluster, spec)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] >= 1]
    # wall-clock seconds from each step's start to the next's, as TRL's are timed (a
    # synchronous step's record is written while the next step's rollouts generate); the
    # last step, with no next, its own time
    starts = [s.start for s in step_times(load(root / "trace"))]
    periods = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    return {
        "step_s": [*periods, steps[-1]["time/step_s"]],
        "reward": [r["train/reward_mean"] for r in steps],
        "rollout_s": [r["time/rollout_s"] for r in steps],
        "update_s": [r["time/update_s"] for r in steps],
        "threads": threads,
    }


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="marl-vs-trl-") as tmp:
        root = Path(args.keep) if args.keep else Path(tmp)
        before = run_trl(args, root / "trl")
        marl = run_marl_single(args, root)
        after = run_trl(args, root / "trl-after")
    w = args.warmup
    # TRL timed before and after marl: a host whose pace drifts during the run weighs on
    # both sides
    trl = {"step_s": before["step_s"][w:] + after["step_s"][w:], "reward": before["reward"]}
    figures: dict[str, Any] = {
        "steps": args.steps,
        "problems": args.problems,
        "group": args.group,
        "max_tokens": args.max_tokens,
        "rank": args.rank,
        "max_staleness": args.max_staleness,
        "learner_threads": marl["threads"]["learner"],
        "inference_threads": marl["threads"]["inference"],
        "trl_step_s": statistics.median(trl["step_s"]),
        "marl_step_s": statistics.median(marl["step_s"][w:]),
        "marl_rollout_s": statistics.median(marl["rollout_s"][w:]),
        "marl_update_s": statistics.median(marl["update_s"][w:]),
        "trl_reward": trl["reward"],
        "marl_reward": marl["reward"],
    }
    figures["marl_over_trl"] = figures["marl_step_s"] / figures["trl_step_s"]
    figures["host"] = host()
    print(
        f"single-agent GRPO, demo model, {args.problems} problems x {args.group}, "
        f"<= {args.max_tokens} tokens, LoRA rank {args.rank}, {args.steps} steps "
        f"(median over steps after {w}); marl train.max_staleness {args.max_staleness}, "
        f"threads: learner {figures['learner_threads']}, "
        f"inference {figures['inference_threads']}"
    )
    print(f"{'':24}{'step s':>10}")
    print(f"{'TRL GRPOTrainer':24}{figures['trl_step_s']:>10.3f}")
    print(
        f"{'marl Single':24}{figures['marl_step_s']:>10.3f}   (rollout "
        f"{figures['marl_rollout_s']:.3f} s, update {figures['marl_update_s']:.3f} s)"
    )
    print(f"marl/TRL step time: {figures['marl_over_trl']:.2f} (goal <= 0.6; project goal 0.5)")
    for name in ("trl", "marl"):
        curve = " ".join(f"{r:+.2f}" for r in figures[f"{name}_reward"])
        print(f"{name:>4} reward by step: {curve}")
    print(describe(figures["host"]))
    emit(figures, args.save)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
