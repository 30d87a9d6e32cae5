"""The sampler/learner gap per adapter on a real PEFT model: ~0 when inference sampled
with the version the learner trains, past the alarm when it kept an older one (a push
that silently failed), and the `sampler_mismatch` alarm names that adapter."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from marl.diagnostics.alarms import scan
from marl.rollout import Rollout
from services.learner.policy import MultiAdapterPolicy
from services.learner.sequences import build_sequences
from services.learner.update import completion_logprobs
from tests.support.batches import ROLES, new_policy, spec, step, voting_batch


@torch.no_grad()
def sampled_by(policy: MultiAdapterPolicy, rollouts: list[Rollout], mode: str) -> list[Rollout]:
    """The rollouts with each turn's log-probs as this policy's current version gives them."""
    out = []
    for r in rollouts:
        turns = []
        for t in r.turns:
            (s,) = build_sequences([dataclasses.replace(r, turns=[t])], [0.0], ROLES[mode])
            policy.activate(s.policy)
            logp, _, _ = completion_logprobs(policy, [s], 1.0)
            turns.append(dataclasses.replace(t, logprobs=logp.tolist()))
        out.append(dataclasses.replace(r, turns=turns))
    return out


def test_gap_is_zero_in_sync_and_alarms_when_inference_serves_an_old_version(
    model_dir: Path,
) -> None:
    s = spec()
    policy = new_policy(model_dir, "isolated", s)
    policy.model.eval()
    rollouts = sampled_by(policy, voting_batch(), "isolated")
    first = step(policy, rollouts, "isolated", s).metrics
    for p in ("generator", "aggregator"):
        assert first[f"policy/{p}/logprob_gap"] < 1e-5
        assert abs(first[f"policy/{p}/logprob_kl"]) < 1e-6

    # the next step's generator turns still come from version 0; the aggregator's are fresh
    fresh = sampled_by(policy, voting_batch(seed=1), "isolated")
    stale = sampled_by(new_policy(model_dir, "isolated", s), voting_batch(seed=1), "isolated")
    mixed = [
        dataclasses.replace(r, turns=[o if o.role == "generator" else f
                                      for o, f in zip(old.turns, r.turns, strict=True)])
        for r, old in zip(fresh, stale, strict=True)
    ]
    second = step(policy, mixed, "isolated", s).metrics
    assert second["policy/generator/logprob_gap"] > s.alarms.logprob_gap_max
    assert second["policy/generator/logprob_kl"] > 0
    assert second["policy/aggregator/logprob_gap"] < 1e-5

    alarms = scan([{"step": 1, **first}, {"step": 2, **second}], s.alarms, shared=False)
    assert [(a.mechanism, a.role, a.step) for a in alarms] == [
        ("sampler_mismatch", "generator", 2)
    ]
