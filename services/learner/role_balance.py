"""`grpo.role_balance`: each role's part of a shared adapter's gradient rescaled to its
weight's share, and `grpo.parallel_slots: scale`: a parallel role's turns of one rollout
weighed 1/N each. Two mitigations of the paper's mechanisms, off by default."""

from __future__ import annotations

from collections import defaultdict

import torch

from marl.spec.run import GRPOSpec
from services.learner import fsdp
from services.learner.policy import MultiAdapterPolicy
from services.learner.sequences import Sequence


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
    """The adapter's gradient becomes Σ_r c_r g_r with
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
