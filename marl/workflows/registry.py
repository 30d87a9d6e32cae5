"""A workflow by the name a RunSpec gives: built-in, installed, or `package.module:VALUE`.

Which names a spec from the network may give is `marl.spec.code_refs`'s decision: a
service passes its `CodePolicy` (the operator's allow-list) where a name arrives; code
that resolves a spec already checked, or one its own user wrote, passes none. A user
workflow is imported on whichever process resolves it (the learner at submit time,
every worker when it runs an episode), so it must be importable on all their Python
paths. Errors are SpecErrors naming the `workflow` field.
"""

from __future__ import annotations

from marl.spec import code_refs
from marl.spec.code_refs import CodePolicy
from marl.spec.run import BUILTIN_WORKFLOWS, SpecError
from marl.workflows.base import Workflow
from marl.workflows.eval_opt import EVAL_OPT
from marl.workflows.orch_workers import ORCH_WORKERS
from marl.workflows.single import SINGLE
from marl.workflows.voting import VOTING

BUILTIN: dict[str, Workflow] = {w.name: w for w in (SINGLE, VOTING, EVAL_OPT, ORCH_WORKERS)}
assert tuple(BUILTIN) == BUILTIN_WORKFLOWS

def check(name: str, policy: CodePolicy) -> None:
    """A SpecError naming `workflow` unless `policy` lets a spec name `name` (no import)."""
    if name not in BUILTIN:
        policy.target(name, "workflow", "workflow", {})


def resolve(name: str, policy: CodePolicy | None = None) -> Workflow:
    """The workflow `name` names; with `policy`, only a name it allows (else a SpecError
    naming the field and the setting). Without one the caller vouches for `name`."""
    if name in BUILTIN:
        return BUILTIN[name]
    if policy is None:
        target = code_refs.entry_points(code_refs.GROUPS["workflow"]).get(name, name)
        if not code_refs.REF.match(target):
            raise SpecError(
                f"field `workflow`: {code_refs.shorten(name)!r} is neither a built-in workflow "
                f"({', '.join(BUILTIN)}), an installed one, nor `package.module:VALUE`"
            )
    else:
        target = policy.target(name, "workflow", "workflow", {})
    value = code_refs.load(target, "workflow")
    if not isinstance(value, Workflow):
        raise SpecError(
            f"field `workflow`: {code_refs.shorten(name)} is a {type(value).__name__}, not a "
            "marl.workflows.Workflow"
        )
    return value
