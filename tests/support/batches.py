"""A hand-made Voting batch and the tiny GRPO spec and policy the learner's unit tests and
memory checks train on: 2 problems x 4 rollouts, each with 3 generator turns and 1
aggregator turn (24 generator and 8 aggregator sequences a step)."""

from __future__ import annotations

import random
from pathlib import Path

from marl.rollout import AdapterRef, Rollout, Turn
from marl.spec.run import RunSpec, parse_spec
from services.learner.policy import MultiAdapterPolicy
from services.learner.update import StepResult, grpo_step

ROLES = {
    "shared": {"generator": "shared", "aggregator": "shared"},
    "isolated": {"generator": "generator", "aggregator": "aggregator"},
}
REWARDS = {"p0": [1.0, 0.0, 0.0, 1.0], "p1": [0.0, 1.0, 1.0, 1.0]}


def turn(role: str, slot: int, rng: random.Random, completion: int = 3) -> Turn:
    prompt = [rng.randrange(3, 52) for _ in range(4)]
    done = [rng.randrange(3, 52) for _ in range(completion)]
    return Turn(role, slot, prompt, done, [-1.0] * completion, "stop", AdapterRef("r/p", 0), "")


def voting_batch(seed: int = 0, aggregator_tokens: int = 2) -> list[Rollout]:
    rng = random.Random(seed)
    out = []
    for pid, rewards in REWARDS.items():
        for k, reward in enumerate(rewards):
            turns = [turn("generator", s, rng) for s in range(3)]
            turns.append(turn("aggregator", 0, rng, aggregator_tokens))
            out.append(Rollout(f"{pid}:{k}", "r", 0, "train", pid, k, turns, "", reward))
    return out


def spec(**grpo: object) -> RunSpec:
    return parse_spec(
        {
            "seed": 1,
            "lora": {"rank": 2, "alpha": 4},
            "optim": {"lr": 0.5, "warmup_steps": 0, "schedule": "constant"},
            "sampling": {"temperature": 1.0},
            "grpo": {"group_size": 4, "micro_batch_sequences": 5, **grpo},
        }
    )


def new_policy(model_dir: Path, policy: str, s: RunSpec) -> MultiAdapterPolicy:
    names = sorted(set(ROLES[policy].values()))
    return MultiAdapterPolicy(str(model_dir), names, s.lora, s.optim, total_steps=10)


def step(policy: MultiAdapterPolicy, rollouts: list[Rollout], mode: str, s: RunSpec) -> StepResult:
    return grpo_step(policy, rollouts, [r.problem_id for r in rollouts], ROLES[mode], s)


def uneven_batch() -> list[Rollout]:
    """Rollout k of a group: (k % 3) + 1 generator turns of 3 tokens, an aggregator of 2 + k."""
    out = voting_batch()
    for r in out:
        for t in r.turns[r.sample % 3 + 1 : 3]:
            t.completion_ids, t.logprobs = [], []
        agg = r.turns[3]
        agg.completion_ids = [5] * (2 + r.sample)
        agg.logprobs = [-1.0] * (2 + r.sample)
    return out
