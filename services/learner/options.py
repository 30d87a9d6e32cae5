"""The objective options and mitigations beyond the paper's GRPO, as the step applies them.

GRPOSpec sets them, each off by default (the step is then the paper's to the last bit,
tests/unit/test_objectives.py): DAPO's overlong band (`shaped_rewards`) and dynamic
sampling, per-role advantages (Dr. MAS's `advantage_norm: role`, and per-role rewards,
role_rewards.py), and the mitigations of the paper's mechanisms: `parallel_slots` (scale
or pool a rollout's parallel turns of one role) and `role_balance` (rescale each role's
part of a shared adapter's gradient). `spec_problems` rejects, at submit, an option that
makes no sense for a run.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Awaitable, Callable

import torch

from marl.diagnostics.signatures import parallel_roles
from marl.rollout import Rollout
from marl.spec.run import GRPOSpec, RunSpec, SpecError, response_cap
from services.learner import fsdp, role_rewards
from services.learner.grpo import good_rollouts, group_advantages, overlong_penalty, signal_groups
from services.learner.metrics import dynamic_sampling_metrics
from services.learner.policy import MultiAdapterPolicy
from services.learner.sequences import Sequence, turn_owners


def spec_problems(spec: RunSpec, roles: dict[str, str]) -> None:
    """The objective options and mitigations a spec sets that make no sense for it, as a
    SpecError naming the field (INVALID_ARGUMENT at submit). `roles`: role -> adapter."""
    g = spec.grpo
    served: dict[str, list[str]] = defaultdict(list)
    for role, adapter in roles.items():
        served[adapter].append(role)
    shared = sorted(a for a, rs in served.items() if len(rs) > 1)
    if spec.guard.on_alarm.get("sp_role_capture") == "split" and not shared:
        raise SpecError(
            "field `guard.on_alarm.sp_role_capture`: split gives a captured role an adapter "
            "of its own, but every adapter of this run serves one role already "
            f"(policy: {spec.policy}); use warn, stop or rollback, or share an adapter"
        )
    if g.role_balance != "none" and not shared:
        raise SpecError(
            f"field `grpo.role_balance`: {g.role_balance} balances the roles of an adapter "
            "that serves several, and no adapter of this run does; set it to none"
        )
    unknown = sorted(set(g.role_weights) - set(roles))
    if unknown:
        raise SpecError(
            f"field `grpo.role_weights`: {', '.join(map(repr, unknown))} is no role of "
            f"{spec.workflow}; its roles are {', '.join(roles)}"
        )
    if g.parallel_slots != "each" and not parallel_roles(spec.workflow):
        why = (
            "marl does not know which roles of a user workflow run in parallel"
            if parallel_roles(spec.workflow) is None
            else f"{spec.workflow} has no parallel same-role slots"
        )
        raise SpecError(
            f"field `grpo.parallel_slots`: {g.parallel_slots} acts on parallel slots, and "
            f"{why}; set it to each"
        )
    if g.advantage_norm == "role" and len(roles) < 2:
        raise SpecError(
            f"field `grpo.advantage_norm`: role normalises each role apart, and {spec.workflow} "
            "has one role (it equals workflow); set it to workflow"
        )
    if g.overlong >= response_cap(spec):
        raise SpecError(
            f"field `grpo.overlong`: the band ({g.overlong} tokens) must be shorter than the "
            f"response cap ({response_cap(spec)}: sampling.max_tokens or the task's)"
        )
    if spec.train.val_pass_at and spec.sampling.validation_temperature == 0:
        raise SpecError(
            "field `train.val_pass_at`: pass@k needs different samples of each problem, and "
            "sampling.val_temperature is 0 (greedy); raise it, e.g. to 0.7"
        )


def shaped_rewards(rollouts: list[Rollout], spec: RunSpec) -> list[float]:
    """Each rollout's reward as the advantages see it: with `grpo.overlong`, plus DAPO's
    soft overlong penalty of its longest turn."""
    g = spec.grpo
    if g.overlong == 0:
        return [r.reward for r in rollouts]
    cap = response_cap(spec)
    return [
        r.reward
        + overlong_penalty(
            max((len(t.completion_ids) for t in r.turns), default=0),
            cap,
            g.overlong,
            g.overlong_penalty,
        )
        for r in rollouts
    ]


def groups_with_signal(rollouts: list[Rollout], spec: RunSpec) -> list[str]:
    """The problems (groups) of `rollouts` that train and carry a comparison, in the order
    they first appear: at least two good rollouts whose rewards (as shaped) differ."""
    groups = [r.problem_id for r in rollouts]
    keep, _ = good_rollouts([r.error is not None for r in rollouts], groups)
    good = [rollouts[i] for i in keep]
    live = signal_groups(shaped_rewards(good, spec), [r.problem_id for r in good])
    return [g for g in dict.fromkeys(groups) if g in live]


async def dynamic_sampling(
    rollouts: list[Rollout],
    more: Callable[[int], Awaitable[list[Rollout]]],
    spec: RunSpec,
) -> tuple[list[Rollout], list[Rollout], dict[str, float]]:
    """DAPO's dynamic sampling (`grpo.dynamic_sampling`): while the step has fewer than
    `train.problems_per_step` groups with signal, `more(n)` runs n further problems
    (the next ones in the data order), at most `grpo.dynamic_sampling_rounds` times.
    Returns every rollout gathered, those of the first problems_per_step groups with
    signal (what trains), and the step's record of it."""
    target = spec.train.problems_per_step
    rounds = 0
    live = groups_with_signal(rollouts, spec)
    while len(live) < target and rounds < spec.grpo.dynamic_sampling_rounds:
        rollouts = rollouts + await more(target - len(live))
        rounds += 1
        live = groups_with_signal(rollouts, spec)
    kept = set(live[:target])
    sampled = len({r.problem_id for r in rollouts})
    return (
        rollouts,
        [r for r in rollouts if r.problem_id in kept],
        dynamic_sampling_metrics(sampled, len(live), rounds, len(kept)),
    )


def sequence_advantages(
    rollouts: list[Rollout], rewards: list[float], groups: list[str], spec: RunSpec
) -> list[float] | None:
    """Per-sequence advantages under `grpo.advantage_norm: role` (Dr. MAS): each role's
    turns normalised over that role's turns in the group, each carrying its rollout's
    reward. None under `workflow` (one advantage per rollout)."""
    g = spec.grpo
    if g.advantage_norm == "workflow":
        return None
    owners = turn_owners(rollouts)
    roles = [t.role for r in rollouts for t in r.turns if t.completion_ids]
    return group_advantages(
        [rewards[k] for k in owners],
        [(groups[k], role) for k, role in zip(owners, roles, strict=True)],
        g.normalize_std,
        baseline=g.baseline,
    )


def per_turn_advantages(
    seqs: list[Sequence],
    rollouts: list[Rollout],
    rewards: list[float],
    groups: list[str],
    spec: RunSpec,
) -> None:
    """Each sequence's advantage its turn's own, where the options say so: per-role
    normalisation, or roles rewarded apart (each normalised over its own rewards)."""
    g = spec.grpo
    per_turn = sequence_advantages(rollouts, rewards, groups, spec)
    if role_rewards.present(rollouts):
        per_turn = role_rewards.sequence_advantages(
            rollouts, rewards, groups, g.normalize_std, g.baseline)
    if per_turn is not None:
        for s, a in zip(seqs, per_turn, strict=True):
            s.advantage = a


def parallel_slot_counts(
    seqs: list[Sequence], owners: list[int], parallel: tuple[str, ...]
) -> list[int]:
    """Per sequence: how many turns of its role its rollout has when the role is a parallel
    one (Voting's generators, Orch-Workers' workers), else 1."""
    count: dict[tuple[int, str], int] = defaultdict(int)
    for s, k in zip(seqs, owners, strict=True):
        count[(k, s.role)] += 1
    return [
        count[(k, s.role)] if s.role in parallel else 1
        for s, k in zip(seqs, owners, strict=True)
    ]


def slot_scale(
    seqs: list[Sequence], owners: list[int], parallel: tuple[str, ...], g: GRPOSpec
) -> list[float] | None:
    """`parallel_slots: scale`: each sequence's loss weight times 1/N, N its rollout's
    turns of its parallel role; None otherwise."""
    if g.parallel_slots != "scale":
        return None
    return [1.0 / n for n in parallel_slot_counts(seqs, owners, parallel)]


def local_grads(policy: MultiAdapterPolicy, p: str) -> list[torch.Tensor]:
    """The adapter's accumulated gradient as this rank holds it (its shard)."""
    return [
        x.grad.detach().clone() if x.grad is not None else torch.zeros_like(x)
        for x in policy.parameters(p)
    ]


def balance_roles(
    policy: MultiAdapterPolicy,
    p: str,
    parts: dict[str, list[torch.Tensor]],
    weights: dict[str, float],
) -> dict[str, float]:
    """`grpo.role_balance`: the adapter's gradient becomes Σ_r c_r g_r with
    c_r = (w_r / Σw) (Σ_q ‖g_q‖) / ‖g_r‖ over the roles whose part is not zero, so each
    role's share of the gradient mass is its weight's and the total mass is kept. Returns
    each role's c_r."""
    norms = {
        r: sum(float((fsdp.full(d) ** 2).sum()) for d in g) ** 0.5 for r, g in parts.items()
    }
    live = [r for r in parts if norms[r] > 0]
    if len(live) < 2:
        return {}
    total = sum(norms[r] for r in live)
    wsum = sum(weights.get(r, 1.0) for r in live)
    scale = {r: weights.get(r, 1.0) / wsum * total / norms[r] for r in live}
    for j, x in enumerate(policy.parameters(p)):
        x.grad = sum((scale[r] * parts[r][j] for r in live[1:]), scale[live[0]] * parts[live[0]][j])
    return scale


class RoleBalance:
    """`grpo.role_balance` over a step: in a mini-batch of several roles, each role's part
    of the adapter's gradient is read apart as it is back-propagated, and the parts are
    rescaled before the optimizer step (`balance_roles`)."""

    def __init__(self, g: GRPOSpec, roles: dict[str, str]):
        """`roles`: role -> adapter."""
        self.on = g.role_balance != "none"
        self.weights = {r: 1.0 for r in roles} if g.role_balance == "equal" else g.role_weights
        self.scales: dict[str, list[float]] = defaultdict(list)
        """Role -> its c_r in each mini-batch balanced (`role/<role>/balance_scale`)."""
        self.active = False
        self.parts: dict[str, list[torch.Tensor]] = {}
        self.start: list[torch.Tensor] | None = None

    def mini_batch(self, roles: set[str]) -> None:
        """A mini-batch of these roles begins: it is balanced when it holds several."""
        self.active = self.on and len(roles) > 1
        self.parts = {}

    def role_starts(self, policy: MultiAdapterPolicy, p: str) -> None:
        if self.active:
            self.start = local_grads(policy, p)

    def role_ends(self, policy: MultiAdapterPolicy, p: str, role: str) -> None:
        if self.active and self.start is not None:
            now = local_grads(policy, p)
            self.parts[role] = [a - z for a, z in zip(now, self.start, strict=True)]
            self.start = None

    def rescale(self, policy: MultiAdapterPolicy, p: str) -> None:
        """Before the mini-batch's optimizer step."""
        if self.active:
            for role, scale in balance_roles(policy, p, self.parts, self.weights).items():
                self.scales[role].append(scale)
