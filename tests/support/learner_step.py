"""One GRPO step of the learner's policy on a tiny Qwen3-shaped model and made-up rollouts,
as the learner-memory and prompt-row tests run it (in-process, or in a child process
whose peak memory is measured)."""

from __future__ import annotations

from pathlib import Path

import torch

from marl.rollout import AdapterRef, Rollout, Turn
from marl.spec.run import parse_spec
from services.learner.policy import MultiAdapterPolicy
from services.learner.sequences import Sequence
from services.learner.update import grpo_step


def tiny_model(out: Path, vocab: int) -> Path:
    """A Qwen3-shaped model from a config (hidden 64, 2 layers) with `vocab` rows."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from marl.models.demo import build_tokenizer

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True,
        max_position_embeddings=512,
    )
    Qwen3ForCausalLM(config).save_pretrained(out)
    build_tokenizer(["What is"]).save_pretrained(out)
    return out


def one_turn(prompt: list[int], completion: list[int]) -> Sequence:
    """A solver's sequence of the shared adapter: `prompt` then `completion`."""
    return Sequence("shared", "solver", prompt + completion, len(prompt), 1.0,
                    [0.0] * len(completion))


def rollouts(n: int, prompt: int, completion: int, vocab: int, seed: int = 0) -> list[Rollout]:
    """`n` single-turn rollouts in groups of 4, rewards 0/1, lengths varying a little."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        c = completion - k % 3
        ids = torch.randint(3, vocab, (prompt + c,), generator=g).tolist()
        turn = Turn("solver", 0, ids[:prompt], ids[prompt:], [-1.0] * c, "stop",
                    AdapterRef("r/p", 0), "")
        out.append(Rollout(f"t{k}", "r", 0, "train", f"p{k // 4}", k % 4, [turn], "",
                           float(k % 2)))
    return out


def run_step(  # type: ignore[no-untyped-def]
    model: Path,
    n: int,
    grpo: dict[str, object],
    chunk_bytes: int | None = None,
    rollouts_: list[Rollout] | None = None,
):
    spec = parse_spec({"seed": 1, "lora": {"rank": 4, "alpha": 8},
                       "optim": {"lr": 0.1, "warmup_steps": 0, "schedule": "constant"},
                       "grpo": {"group_size": 4, "mini_batch_size": 2, **grpo}})
    policy = MultiAdapterPolicy(str(model), ["shared"], spec.lora, spec.optim, total_steps=4)
    if chunk_bytes is not None:
        policy.logit_chunk_bytes = chunk_bytes
    rs = rollouts_ or rollouts(n, 6, 10, 500)
    result = grpo_step(policy, rs, [r.problem_id for r in rs], {"solver": "shared"}, spec)
    return result, policy.state_dict("shared")
