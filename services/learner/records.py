"""A step's record: its metrics' names and the builders that make them.

A record is one dict per logged step (`{"step": n, "<group>/<name>": value, ...}`); every
name in it is made here: `train/` (the step's rollouts and update), `time/` (its phases,
from step_clock.py), `role/<role>/` and `policy/<adapter>/` (per role and per adapter).
sinks.py says where it goes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from marl.diagnostics.signatures import role_signatures
from marl.rollout import Rollout, mean_facts

if TYPE_CHECKING:
    from services.learner.diagnostics import ImportanceStats, OldSums, RoleSignals
    from services.learner.step_clock import StepClock
    from services.learner.update import MiniBatchStats


def rollout_metrics(rollouts: list[Rollout]) -> dict[str, float]:
    """Outcome and per-role response shape of one step's rollouts."""
    from marl.rewards.math_scoring import last_boxed

    out: dict[str, float] = {}
    rewards = [r.reward for r in rollouts]
    out["train/reward_mean"] = sum(rewards) / max(len(rewards), 1)
    out["train/accuracy"] = sum(r >= 1.0 for r in rewards) / max(len(rewards), 1)
    out["train/episode_errors"] = sum(r.error is not None for r in rollouts)
    out.update(mean_facts(rollouts, "train"))
    by_role: dict[str, list[Any]] = {}
    for r in rollouts:
        for t in r.turns:
            by_role.setdefault(t.role, []).append(t)
    for role, turns in by_role.items():
        lengths = sorted(len(t.completion_ids) for t in turns)
        out[f"role/{role}/response_len_mean"] = sum(lengths) / len(lengths)
        out[f"role/{role}/response_len_p50"] = lengths[len(lengths) // 2]
        out[f"role/{role}/response_len_p95"] = lengths[
            min(len(lengths) - 1, int(0.95 * len(lengths)))
        ]
        out[f"role/{role}/truncation_rate"] = sum(t.finish_reason == "length" for t in turns) / len(
            turns
        )
        out[f"role/{role}/boxed_rate"] = sum(last_boxed(t.text) is not None for t in turns) / len(
            turns
        )
    return out


def step_record(
    rollouts: list[Rollout],
    workflow: str,
    update: dict[str, float],
    selection: dict[str, float],
    failed_step: bool,
    clock: StepClock,
    burst_s: float | None,
) -> dict[str, Any]:
    """A trained step's record before its push: what its rollouts say, the role signatures
    the drift alarms read, the update's metrics, what the selection of the rollouts that
    train dropped (staleness, dynamic sampling) and the phases' times so far."""
    return {
        **rollout_metrics(rollouts),
        **role_signatures(rollouts, workflow),
        **update,
        **selection,
        "train/episodes": len(rollouts),
        "train/failed_step": int(failed_step),
        **clock.times(burst_s),
    }


def dynamic_sampling_metrics(sampled: int, live: int, rounds: int, kept: int) -> dict[str, float]:
    """DAPO's dynamic sampling of a step: the share of the `sampled` groups with no signal
    (of which `live` had one), its top-up rounds and the groups kept."""
    return {
        "train/dynamic_sampling_dropped": 1.0 - live / max(sampled, 1),
        "train/dynamic_sampling_rounds": rounds,
        "train/dynamic_sampling_groups": kept,
    }


def update_metrics(
    *,
    lr: float,
    lrs: dict[str, float],
    sequences: int,
    groups_dropped: int,
    penalties: list[float] | None,
    diagnostics: dict[str, float],
    mini_batches: Sequence[MiniBatchStats],
    kl: bool,
    balance_scales: dict[str, list[float]],
) -> dict[str, float]:
    """A GRPO step's metrics: the learning rates (`lr`: the first adapter's, `lrs` those of
    the routed adapters), its sequences and dropped groups, the mean overlong penalty (with
    `grpo.overlong`), the diagnostics' own (`StepDiagnostics.metrics`; none yet when they
    are measured after the push), each adapter's mini-batches (with its KL to the base
    model when `kl`) and the role balance's scales."""
    m: dict[str, float] = {
        "train/lr": lr,
        **{f"policy/{p}/lr": v for p, v in lrs.items()},
        "train/sequences": sequences,
        "train/groups_dropped": groups_dropped,
    }
    if penalties is not None:
        m["train/overlong_penalty_mean"] = sum(penalties) / max(len(penalties), 1)
    m.update(diagnostics)
    m.update(mini_batch_metrics(mini_batches, kl))
    for role, scales in balance_scales.items():
        m[f"role/{role}/balance_scale"] = sum(scales) / len(scales)
    return m


def mini_batch_metrics(mini_batches: Sequence[MiniBatchStats], kl: bool) -> dict[str, float]:
    """Per adapter: its optimizer steps, and their mean grad norm (each one optimizer step's,
    pre-clip; `role/<role>/grad_norm` is averaged the same way), loss and (`kl`) KL to the
    base model; the share of its tokens clipped below and above."""
    per_policy: dict[str, list[MiniBatchStats]] = defaultdict(list)
    for st in mini_batches:
        per_policy[st.policy].append(st)
    m: dict[str, float] = {}
    for p, sts in per_policy.items():
        m[f"policy/{p}/optimizer_steps"] = len(sts)
        m[f"policy/{p}/grad_norm"] = sum(s.grad_norm for s in sts) / len(sts)
        m[f"policy/{p}/loss"] = sum(s.loss for s in sts) / len(sts)
        tokens = max(sum(s.tokens for s in sts), 1)
        m[f"policy/{p}/clip_low_fraction"] = sum(s.clipped_low for s in sts) / tokens
        m[f"policy/{p}/clip_high_fraction"] = sum(s.clipped_high for s in sts) / tokens
        if kl:
            m[f"policy/{p}/kl_ref"] = sum(s.kl for s in sts) / len(sts)
    return m


def signal_metrics(signals: RoleSignals) -> dict[str, float]:
    """The per-role and per-adapter signals of diagnostics.py, as means."""
    out: dict[str, float] = {}
    grad = {role: signals.grad_norm(role) for role in signals.roles}
    total_grad = sum(grad.values())
    for role, r in sorted(signals.roles.items()):
        pre = f"role/{role}/"
        out.update(old_metrics(r.old, pre))
        out[pre + "entropy"] = r.entropy / max(r.old.tokens, 1)
        out[pre + "clip_fraction"] = r.clipped / max(r.updated_tokens, 1)
        out[pre + "grad_norm"] = grad[role]
        out[pre + "grad_share"] = grad[role] / total_grad if total_grad > 0 else 0.0
        if r.old.sampled:
            out[pre + "kl_base"] = r.kl_base / r.old.sampled
    for policy, p in sorted(signals.policies.items()):
        pre = f"policy/{policy}/"
        out.update(old_metrics(p, pre))
        out[pre + "logprob_kl"] = p.kl / max(p.tokens, 1)
    return out


def old_metrics(sums: OldSums, prefix: str) -> dict[str, float]:
    """χ², training perplexity, the sampler gap and the update's χ² of a role or adapter."""
    out = {
        prefix + "chi2_token": sums.chi2_token / max(sums.tokens, 1),
        prefix + "training_ppl": sums.ppl / sums.sequences if sums.sequences else 1.0,
        prefix + "logprob_gap": sums.logprob_gap / max(sums.tokens, 1),
    }
    if sums.sampled:
        out[prefix + "update_chi2"] = sums.update_chi2 / sums.sampled
    return out


def importance_metrics(stats: ImportanceStats) -> dict[str, float]:
    n = max(stats.tokens, 1)
    return {
        "train/importance_weight_mean": stats.total / n,
        "train/importance_truncated_fraction": stats.truncated / n,
    }
