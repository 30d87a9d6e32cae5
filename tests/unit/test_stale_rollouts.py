"""Bounded staleness: which rollouts are dropped, the behaviour weights of off-policy
tokens, the replica's newest-version lookup, and K = 0 left exactly as before."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch
from test_grpo_minibatch import new_policy, spec, step, voting_batch

from marl.rollout import AdapterRef, Rollout, Turn
from services.inference.adapters import AdapterNotLoaded, AdapterRegistry, LoadedVersion
from services.learner.diagnostics import ImportanceStats
from services.learner.grpo import behaviour_weights
from services.learner.staleness import drop_stale


def rollout(task: str, *versions: tuple[str, int], error: str | None = None) -> Rollout:
    turns = [Turn("r", i, [1], [2], [-1.0], "stop", AdapterRef(name, v), "")
             for i, (name, v) in enumerate(versions)]
    return Rollout(task, "run", 0, "train", "p", 0, turns, "", 1.0, error=error)


def test_a_rollout_with_any_turn_past_k_versions_is_dropped_whole() -> None:
    current = {"run/gen": 5, "run/agg": 3}
    rollouts = [
        rollout("fresh", ("run/gen", 5), ("run/agg", 3)),
        rollout("one-behind", ("run/gen", 4), ("run/agg", 3)),
        rollout("mixed", ("run/gen", 5), ("run/agg", 1)),  # the aggregator 2 behind
        rollout("failed", ("run/gen", 0), error="sandbox down"),
    ]
    kept, m = drop_stale(rollouts, current, max_staleness=1)
    assert [r.error for r in kept] == [
        None, None, "stale: a turn 2 versions behind (train.max_staleness=1)", "sandbox down"
    ]
    # lags of the six turns of the three that ran: 0, 0, 1, 0, 0, 2
    assert m == {"train/stale_dropped": 1.0, "train/staleness_mean": 0.5,
                 "train/staleness_max": 2.0}
    kept, m = drop_stale(rollouts, current, max_staleness=2)
    assert m["train/stale_dropped"] == 0 and kept[:3] == rollouts[:3]


def test_behaviour_weights_are_pi_old_over_mu_truncated() -> None:
    old = torch.tensor([math.log(0.5), math.log(0.5), math.log(0.9)])
    mu = [math.log(0.5), math.log(0.25), math.log(0.3)]
    w = behaviour_weights(old, mu, cap=2.0)
    assert w.tolist() == pytest.approx([1.0, 2.0, 2.0])  # 0.5/0.5, 0.5/0.25, 3.0 -> 2
    stats = ImportanceStats()
    stats.add(w, 2.0)
    stats.add(behaviour_weights(old[:1], [math.log(1.0)], cap=2.0), 2.0)  # 0.5
    assert stats.metrics() == pytest.approx(
        {"train/importance_weight_mean": 5.5 / 4, "train/importance_truncated_fraction": 0.5}
    )


def test_synchronous_step_loss_is_unchanged(model_dir: Path) -> None:
    """The mini-batch losses of the code before bounded staleness existed, same seed.

    The first two (before any update, and after one) hold to 1e-6 on any CPU. After
    two AdamW steps the float summation order of the machine shows: AdamW divides
    each gradient by its own root mean square, so the last bits of tiny gradients
    (which differ with the thread count and SIMD width) move whole steps; the later
    losses differed by 1.5e-4 relative between the machine that pinned them and an
    AMD EPYC machine of the same kind, and again with 1 thread instead of 2."""
    s = spec(mini_batch_size=2)
    policy = new_policy(model_dir, "shared", s)
    result = step(policy, voting_batch(), "shared", s)
    losses = [mb.loss for mb in result.mini_batches]
    expected = [
        -0.0792466253042221, 0.09426321089267731, 0.22887663543224335, -0.15414685010910034
    ]
    assert losses[:2] == pytest.approx(expected[:2], rel=1e-6)
    assert losses == pytest.approx(expected, rel=1e-3)
    assert "train/importance_weight_mean" not in result.metrics


def test_off_policy_step_weights_tokens_by_the_sampler(model_dir: Path) -> None:
    """At K >= 1 the sampler's log-probs enter the loss: the voting batch's placeholder
    log-probs (-1 for every token) give other losses than the synchronous step."""
    s = spec(mini_batch_size=2)
    off = s.model_copy(update={"train": s.train.model_copy(update={"max_staleness": 1})})
    sync = step(new_policy(model_dir, "shared", s), voting_batch(), "shared", s)
    late = step(new_policy(model_dir, "shared", s), voting_batch(), "shared", off)
    assert late.metrics["train/importance_weight_mean"] > 0
    assert [mb.loss for mb in late.mini_batches] != pytest.approx(
        [mb.loss for mb in sync.mini_batches]
    )


def test_replica_serves_the_newest_version_at_least_the_asked_one() -> None:
    async def go() -> None:
        unloaded: list[str] = []

        async def unload(key: str) -> None:
            unloaded.append(key)

        reg = AdapterRegistry(unload, retention=2)
        for v in (3, 4, 5):
            await reg.added(LoadedVersion("run/p", v, v, "sha"))
        assert reg.acquire("run/p", 4).version == 4
        assert reg.acquire("run/p", 4, newest=True).version == 5
        assert reg.acquire("run/p", 1, newest=True).version == 5  # older: newest held
        with pytest.raises(AdapterNotLoaded):
            reg.acquire("run/p", 6, newest=True)
        with pytest.raises(AdapterNotLoaded):
            reg.acquire("run/p", 3)  # retired by retention 2

    asyncio.run(go())
