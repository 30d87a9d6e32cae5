"""Bounded staleness: which rollouts are dropped, the behaviour weights of off-policy
tokens, the replica's newest-version lookup, and K = 0 left exactly as before."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch

from marl.rollout import AdapterRef, Rollout, Turn
from services.inference.adapters import AdapterNotLoaded, AdapterRegistry, LoadedVersion
from services.learner.diagnostics import ImportanceStats
from services.learner.grpo import behaviour_weights
from services.learner.staleness import drop_stale
from tests.support.batches import new_policy, spec, step, voting_batch


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


def test_synchronous_step_ignores_the_samplers_logprobs(model_dir: Path) -> None:
    """At K = 0 the loss is the on-policy one: the sampler's log-probs enter nothing, so
    two batches that differ only in them give bit-identical losses (one process, one
    kernel set), and no importance weight is logged. The golden step in test_objectives
    holds the values themselves."""
    s = spec(mini_batch_size=2)
    batch = voting_batch()
    shifted = voting_batch()
    for rollout in shifted:
        for t in rollout.turns:
            t.logprobs[:] = [-0.25 * (i + 1) for i in range(len(t.logprobs))]
    sync = step(new_policy(model_dir, "shared", s), batch, "shared", s)
    other = step(new_policy(model_dir, "shared", s), shifted, "shared", s)
    assert [mb.loss for mb in sync.mini_batches] == [mb.loss for mb in other.mini_batches]
    assert "train/importance_weight_mean" not in sync.metrics


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
