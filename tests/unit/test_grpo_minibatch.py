"""Mini-batches as the paper counts them, on a hand-made Voting batch and a tiny real model.

2 problems x 4 rollouts, each with 3 generator turns and 1 aggregator turn: 24 generator
sequences and 8 aggregator sequences per step.
"""

from __future__ import annotations

import math
import random
import warnings
from pathlib import Path

import pytest
import torch

from marl.spec.run import RunSpec, parse_spec
from services.learner.advantages import good_rollouts, group_advantages
from services.learner.batching import plan_mini_batches
from tests.support.batches import (
    REWARDS,
    new_policy,
    spec,
    step,
    uneven_batch,
    voting_batch,
)


@pytest.mark.parametrize(
    ("mode", "size", "expected"),
    [
        # SP: 32 sequences in one stream; IP: 24 generator, 8 aggregator sequences;
        # a mini-batch of `size` problems holds size x 4 (the group) sequences
        ("shared", 2, {"shared": 4}),
        ("isolated", 2, {"generator": 3, "aggregator": 1}),
        ("shared", 3, {"shared": 3}),  # ceil(32 / 12)
        ("isolated", 3, {"generator": 2, "aggregator": 1}),  # ceil(24 / 12), ceil(8 / 12)
        ("isolated", 1, {"generator": 6, "aggregator": 2}),  # 24 / 4, 8 / 4
    ],
)
def test_optimizer_steps_per_adapter(
    model_dir: Path, mode: str, size: int, expected: dict[str, int]
) -> None:
    s = spec(mini_batch_size=size)
    policy = new_policy(model_dir, mode, s)
    result = step(policy, voting_batch(), mode, s)
    steps = {p: int(result.metrics[f"policy/{p}/optimizer_steps"]) for p in expected}
    assert steps == expected
    first = sorted(expected)[0]
    assert [mb.sequences for mb in result.mini_batches if mb.policy == first][:1] == [
        min(size * 4, {"aggregator": 8, "generator": 24, "shared": 32}[first])
    ]


def test_plan_is_a_shuffled_partition_per_epoch() -> None:
    from services.learner.sequences import Sequence

    seqs = [Sequence("a" if i % 4 else "b", "r", [1, 2], 1, 0.0, [0.0]) for i in range(12)]
    plan = plan_mini_batches(seqs, 4, 2, random.Random(0))
    assert [len(mb) for mb in plan["a"]] == [4, 5, 4, 5]  # 9 at 4: the 1 left joins the 4
    assert [len(mb) for mb in plan["b"]] == [3, 3]
    for p, n in (("a", 9), ("b", 3)):
        per_epoch = len(plan[p]) // 2
        for e in range(2):
            got = sorted(i for mb in plan[p][e * per_epoch : (e + 1) * per_epoch] for i in mb)
            assert len(got) == n and all(seqs[i].policy == p for i in got)


@pytest.mark.parametrize(
    ("sequences", "sizes"),
    [
        (513, [513]),  # a remainder of 1 is no optimizer step of its own
        (767, [767]),  # 255 < 256, half of 512
        (768, [512, 256]),  # half of 512 is a mini-batch of its own
        (1025, [512, 513]),
        (512, [512]),
        (200, [200]),  # one short mini-batch is still one
    ],
)
def test_a_remainder_under_half_a_mini_batch_joins_the_one_before(
    sequences: int, sizes: list[int]
) -> None:
    from services.learner.batching import cut
    from services.learner.sequences import Sequence

    seqs = [Sequence("shared", "generator", [1, 2], 1, 0.0, [0.0]) for _ in range(sequences)]
    plan = plan_mini_batches(seqs, 512, 1, random.Random(0))
    assert [len(mb) for mb in plan["shared"]] == sizes
    assert sorted(i for mb in plan["shared"] for i in mb) == list(range(sequences))
    # pooled units (grpo.parallel_slots: pool) are cut by the same rule, counted in units
    units = [i // 3 for i in range(3 * 7)]  # 7 units of 3 sequences, 3 units a mini-batch
    pooled = plan_mini_batches(
        [Sequence("shared", "generator", [1, 2], 1, 0.0, [0.0]) for _ in units],
        3,
        1,
        random.Random(0),
        units,
    )
    assert [len(mb) for mb in pooled["shared"]] == [9, 12]  # units [3, 4]: the 1 left joins
    assert cut([1, 2, 3, 4, 5], 4) == [[1, 2, 3, 4, 5]] and cut([1, 2, 3], 2) == [[1, 2], [3]]


def test_first_mini_batch_is_on_policy_later_ones_clip_at_both_bounds(model_dir: Path) -> None:
    s = spec(mini_batch_size=4)
    policy = new_policy(model_dir, "shared", s)
    result = step(policy, voting_batch(), "shared", s)
    first, second = result.mini_batches
    assert first.ratio_min == pytest.approx(1.0, abs=1e-6)
    assert first.ratio_max == pytest.approx(1.0, abs=1e-6)
    assert first.clipped_low == first.clipped_high == 0
    # lr 0.5 moves the policy far in one step: π/π_old leaves [0.8, 1.28] both ways
    assert second.ratio_min < 1 - 0.2 and second.ratio_max > 1 + 0.28
    assert second.clipped_low > 0 and second.clipped_high > 0
    assert result.metrics["role/generator/clip_fraction"] > 0


def test_isolated_roles_change_only_their_own_adapter(model_dir: Path) -> None:
    s = spec(mini_batch_size=2)
    policy = new_policy(model_dir, "isolated", s)
    rollouts = voting_batch()
    for r in rollouts:  # only generators emitted tokens
        r.turns[-1].completion_ids = []
        r.turns[-1].logprobs = []
    before = {p: policy.state_dict(p) for p in policy.policies}
    result = step(policy, rollouts, "isolated", s)
    assert "policy/aggregator/optimizer_steps" not in result.metrics
    after = {p: policy.state_dict(p) for p in policy.policies}
    for k, v in before["aggregator"].items():
        assert torch.equal(v, after["aggregator"][k]), k
    assert any(not torch.equal(v, after["generator"][k]) for k, v in before["generator"].items())


def test_failed_episodes_leave_their_group() -> None:
    groups = ["a"] * 4 + ["b"] * 4 + ["c"] * 3
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    errors = [False, True, False, False, False, False, False, True, True, True, False]
    keep, dropped = good_rollouts(errors, groups)
    # group c keeps one good rollout: no comparison, dropped
    assert keep == [0, 2, 3, 4, 5, 6]
    assert dropped == 1
    adv = group_advantages([rewards[i] for i in keep], [groups[i] for i in keep], eps=0.0)
    # a: 1, 0, 1 -> mean 2/3, std sqrt(1/3); b: 0, 1, 1 -> the same numbers mirrored
    sd = math.sqrt(1 / 3)
    assert adv == pytest.approx(
        [(1 / 3) / sd, (-2 / 3) / sd, (1 / 3) / sd, (-2 / 3) / sd, (1 / 3) / sd, (1 / 3) / sd]
    )


def test_a_failed_episode_changes_no_other_advantage_and_trains_nothing(model_dir: Path) -> None:
    s = spec(mini_batch_size=16, loss_agg="token_mean")
    clean = voting_batch()
    failed = voting_batch()
    extra = voting_batch(seed=5)[0]  # a p0 rollout whose episode failed: reward 0
    extra.task_id, extra.sample, extra.reward, extra.error = "p0:x", 9, 0.0, "sandbox down"
    failed.insert(2, extra)
    a, b = new_policy(model_dir, "shared", s), new_policy(model_dir, "shared", s)
    ra, rb = step(a, clean, "shared", s), step(b, failed, "shared", s)
    assert ra.metrics["train/sequences"] == rb.metrics["train/sequences"] == 32
    assert ra.metrics["policy/shared/loss"] == rb.metrics["policy/shared/loss"]
    for k, v in a.state_dict("shared").items():
        assert torch.equal(v, b.state_dict("shared")[k]), k


def test_loss_aggregations_as_worked_out(model_dir: Path) -> None:
    """On-policy (ratio 1, one mini-batch) the loss is -Σ w·A: token_mean weighs each
    rollout's advantage by its tokens, seq_mean_token_mean by its sequences."""
    losses = {}
    for agg in ("token_mean", "seq_mean_token_mean"):
        s = spec(mini_batch_size=16, loss_agg=agg)
        policy = new_policy(model_dir, "shared", s)
        losses[agg] = step(policy, uneven_batch(), "shared", s).metrics["policy/shared/loss"]
    adv = group_advantages(
        [r for rs in REWARDS.values() for r in rs], [p for p, rs in REWARDS.items() for _ in rs]
    )
    ks = [k for _ in REWARDS for k in range(4)]
    tokens = [3 * (k % 3 + 1) + 2 + k for k in ks]  # 5, 9, 13, 8 per group
    seqs = [k % 3 + 1 + 1 for k in ks]  # 2, 3, 4, 2 per group
    token_mean = -sum(a * t for a, t in zip(adv, tokens, strict=True)) / sum(tokens)
    seq_mean = -sum(a * n for a, n in zip(adv, seqs, strict=True)) / sum(seqs)
    assert token_mean != pytest.approx(seq_mean)
    assert losses["token_mean"] == pytest.approx(token_mean, abs=1e-6)
    assert losses["seq_mean_token_mean"] == pytest.approx(seq_mean, abs=1e-6)


def test_renamed_field_is_refused_naming_the_new_one() -> None:
    from marl.spec.run import SpecError

    with pytest.raises(SpecError, match="grpo.mini_batch_size"):
        parse_spec({"grpo": {"mini_batch_problems": 4}})


def test_building_the_policy_warns_of_nothing(model_dir: Path) -> None:
    """PEFT reads transformers' deprecated `is_gradient_checkpointing` when it wraps the
    model; that FutureWarning is not the user's to act on, so the learner's log omits it."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        new_policy(model_dir, "shared", spec())


TURNS = {
    # role turns per episode at the paper's caps (3 voters, 3 workers)
    "single": {"generator": 1},
    "voting": {"generator": 3, "aggregator": 1},
    "orch_workers": {"orchestrator": 1, "worker": 3, "synthesizer": 1},
    # Eval-Opt with R rounds, every verdict Incorrect: R + 1 answers, R evaluations
    "eval_opt_1": {"generator": 2, "evaluator": 1},
    "eval_opt_3": {"generator": 4, "evaluator": 3},
    # ... or the first answer judged Correct at once
    "eval_opt_correct": {"generator": 1, "evaluator": 1},
}


@pytest.mark.parametrize(
    ("episode", "policy", "expected"),
    [
        # 64 problems x 8 rollouts = 512 episodes; a mini-batch: 64 x 8 = 512 sequences
        ("single", "shared", {"shared": 1}),
        ("single", "isolated", {"generator": 1}),
        ("voting", "shared", {"shared": 4}),  # 2048 / 512
        ("voting", "isolated", {"generator": 3, "aggregator": 1}),
        ("orch_workers", "shared", {"shared": 5}),
        ("orch_workers", "isolated", {"orchestrator": 1, "worker": 3, "synthesizer": 1}),
        ("eval_opt_1", "shared", {"shared": 3}),
        ("eval_opt_1", "isolated", {"generator": 2, "evaluator": 1}),
        ("eval_opt_3", "shared", {"shared": 7}),
        ("eval_opt_3", "isolated", {"generator": 4, "evaluator": 3}),
        ("eval_opt_correct", "shared", {"shared": 2}),
    ],
)
def test_optimizer_steps_at_the_papers_defaults(
    episode: str, policy: str, expected: dict[str, int]
) -> None:
    from services.learner.sequences import Sequence

    g = RunSpec().grpo
    assert (g.mini_batch_size, g.group_size, g.epochs, g.sequences_per_mini_batch) == (
        64,
        8,
        1,
        512,
    )
    episodes = RunSpec().train.problems_per_step * g.group_size
    seqs = [
        Sequence("shared" if policy == "shared" else role, role, [1, 2], 1, 0.0, [0.0])
        for _ in range(episodes)
        for role, n in TURNS[episode].items()
        for _ in range(n)
    ]
    plan = plan_mini_batches(seqs, g.sequences_per_mini_batch, g.epochs, random.Random(0))
    assert {p: len(mbs) for p, mbs in plan.items()} == expected


def test_epochs_multiply_the_steps() -> None:
    from services.learner.sequences import Sequence

    g = parse_spec({"grpo": {"epochs": 2, "mini_batch_size": 32}}).grpo
    seqs = [Sequence("shared", "generator", [1, 2], 1, 0.0, [0.0]) for _ in range(512)]
    plan = plan_mini_batches(seqs, g.sequences_per_mini_batch, g.epochs, random.Random(0))
    assert len(plan["shared"]) == 2 * 512 // (32 * 8)
