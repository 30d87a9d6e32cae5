"""The objective options and mitigations a spec sets that make no sense for the run it
describes, rejected at submit (INVALID_ARGUMENT) with the field named."""

from __future__ import annotations

from collections import defaultdict

from marl.diagnostics.signatures import parallel_roles
from marl.spec.run import RunSpec, SpecError, response_cap


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
    if g.torch_compile and spec.learner.world_size > 1:
        raise SpecError(
            "field `grpo.torch_compile`: compiling is for one learner process, and "
            f"learner.world_size is {spec.learner.world_size}; set it to false"
        )
    if spec.train.val_pass_at and spec.sampling.validation_temperature == 0:
        raise SpecError(
            "field `train.val_pass_at`: pass@k needs different samples of each problem, and "
            "sampling.val_temperature is 0 (greedy); raise it, e.g. to 0.7"
        )
