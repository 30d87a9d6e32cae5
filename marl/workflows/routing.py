"""Which adapter (policy) serves each role of a run's workflow."""

from __future__ import annotations

from marl.rewards.spec_checks import check_reward
from marl.spec.run import RunSpec, SpecError
from marl.workflows.registry import resolve

RENAMED_ROLES = {"single": {"solver": "generator"}}
"""Roles renamed since earlier versions, refused by name with the new one."""


def policy_of_role(spec: RunSpec) -> dict[str, str]:
    """Role -> policy (adapter) name. Shared: one for all; isolated: one per role type.

    Also the submit-time check of the spec's workflow (importable, a Workflow, every one
    of its roles covered by `policy_groups`, its `workflow_args`), of its reward function
    and of `optim.policy_lr`'s adapter names. A judge role (`reward.judge.role`) is routed
    only when `policy_groups` names it: then it trains; otherwise it is frozen."""
    mapping = _policy_of_role(spec)
    resolve(spec.workflow).parse_args(spec.workflow_args)
    check_reward(spec)
    unknown = sorted(set(spec.optim.policy_lr) - set(mapping.values()))
    if unknown:
        raise SpecError(
            f"field `optim.policy_lr`: no adapter named {', '.join(map(repr, unknown))} in this "
            f"run; its adapters are {', '.join(sorted(set(mapping.values())))}"
        )
    return mapping


def adapter_versions_in_flight(spec: RunSpec) -> int:
    """Adapter versions the run's requests may name at once, what a vLLM replica's
    `max_loras` should be for it: `train.versions_per_adapter` of each adapter."""
    return len(set(policy_of_role(spec).values())) * spec.train.versions_per_adapter


def _policy_of_role(spec: RunSpec) -> dict[str, str]:
    roles = resolve(spec.workflow).roles
    judge = spec.reward.judge
    if judge is not None and judge.role in (spec.policy_groups or {}) and judge.role not in roles:
        roles = (*roles, judge.role)  # a judge trained: a policy group names its role
    if spec.policy_groups is not None:
        for old, new in RENAMED_ROLES.get(spec.workflow, {}).items():
            if old in spec.policy_groups:
                raise SpecError(
                    f"field `policy_groups.{old}`: the {spec.workflow} workflow's role "
                    f"`{old}` is now called `{new}`; rename the key"
                )
        unknown = sorted(set(spec.policy_groups) - set(roles))
        missing = [r for r in roles if r not in spec.policy_groups]
        if unknown or missing:
            raise SpecError(
                f"field `policy_groups`: must map every role of {spec.workflow} "
                f"({', '.join(roles)}) to a policy name"
                + (f"; unknown roles {unknown}" if unknown else "")
                + (f"; missing roles {missing}" if missing else "")
            )
        for role, group in spec.policy_groups.items():
            if not group.replace("_", "").replace("-", "").isalnum():
                raise SpecError(f"field `policy_groups.{role}`: {group!r} must be alphanumeric")
        return dict(spec.policy_groups)
    if spec.policy == "shared":
        return {role: "shared" for role in roles}
    return {role: role for role in roles}
