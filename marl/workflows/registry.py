"""A workflow by the name a RunSpec gives: built-in, or `package.module:VALUE`.

A user workflow is imported on whichever process resolves it (the learner at
submit time, every worker when it runs an episode), so it must be importable
on all their Python paths. Errors are SpecErrors naming the `workflow` field.
"""

from __future__ import annotations

import importlib

from marl.spec.run import BUILTIN_WORKFLOWS, SpecError
from marl.workflows.base import Workflow
from marl.workflows.eval_opt import EVAL_OPT
from marl.workflows.orch_workers import ORCH_WORKERS
from marl.workflows.single import SINGLE
from marl.workflows.voting import VOTING

BUILTIN: dict[str, Workflow] = {w.name: w for w in (SINGLE, VOTING, EVAL_OPT, ORCH_WORKERS)}
assert tuple(BUILTIN) == BUILTIN_WORKFLOWS


def resolve(name: str) -> Workflow:
    if name in BUILTIN:
        return BUILTIN[name]
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise SpecError(
            f"field `workflow`: {name!r} is neither a built-in workflow "
            f"({', '.join(BUILTIN)}) nor `package.module:VALUE`"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # the user's module: any failure to import it is theirs to fix
        raise SpecError(
            f"field `workflow`: cannot import module {module_name!r} "
            f"({type(err).__name__}: {err}); it must be importable on the learner's and "
            "the workers' Python path"
        ) from None
    value = getattr(module, attr, None)
    if value is None:
        raise SpecError(f"field `workflow`: module {module_name!r} has no {attr!r}")
    if not isinstance(value, Workflow):
        raise SpecError(
            f"field `workflow`: {name} is a {type(value).__name__}, not a "
            "marl.workflows.Workflow"
        )
    return value
