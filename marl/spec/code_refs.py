"""Which code a run spec may name, and importing it without letting it stop the process.

A run spec names code by `workflow:`, `reward.function:` and the tools a workflow
offers. Specs and tasks come from the network (SubmitRun, a Redis task, RunEpisode),
so a name is never imported because it happens to be importable. It must be one of:

- marl's built-ins (a static table per kind: `voting`, `marl.rewards.builtin:math_reward`);
- an entry point of an installed package in the kind's group (`marl.workflows`,
  `marl.rewards`, `marl.tools`), by its entry-point name or by the `module:NAME` it
  points to: installing a package is the operator's act;
- `module:NAME` whose module lies under a prefix in the operator's allow-list
  (`allowed_modules` in the learner's and the workers' service config; `marl demo` and
  `marl up` allow the modules of the directory they start in, where the user is the
  operator).

`CodePolicy.target` decides without importing anything. `load` then imports what passed:
any way an import can fail, `SystemExit` and `KeyboardInterrupt` included (a module whose
top level calls `sys.exit`), is a SpecError naming the field, never the end of the
service. What this does not protect against: an allowed module is trusted code, run
with the service's rights; one that calls `os._exit` or spins forever at import still
ends or stalls the process. The allow-list is how the operator vouches for it.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from marl.spec.run import SpecError

Kind = Literal["workflow", "reward", "tool"]
GROUPS: dict[Kind, str] = {
    "workflow": "marl.workflows",
    "reward": "marl.rewards",
    "tool": "marl.tools",
}
"""The entry-point group an installed package registers each kind of code under."""

REF = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")
"""`package.module:NAME`."""
MODULE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")

LOCAL_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
MAX_MODULES = 1024
"""Bound of an allow-list (`allowed_modules`)."""

T = TypeVar("T")


@dataclass(frozen=True)
class CodePolicy:
    """The operator's allow-list of module prefixes, and the setting a refusal names."""

    modules: tuple[str, ...] = ()
    """Module prefixes (`mylab`, `mylab.rewards`): a prefix allows itself and its
    submodules, never a longer name (`mylab` does not allow `mylab_evil`)."""
    setting: str = "allowed_modules"
    """Where the operator sets `modules`, as a refusal tells the user, e.g. `the learner's
    allowed_modules (MARL_LEARNER_ALLOWED_MODULES)`."""

    def allows_module(self, module: str) -> bool:
        return any(module == p or module.startswith(p + ".") for p in self.modules)

    def target(self, name: str, kind: Kind, field: str, builtins: Mapping[str, str]) -> str:
        """The `module:NAME` that `name` stands for when a spec may name it (see the
        module's docstring); else a SpecError naming `field` and the setting to change.
        Imports nothing."""
        if name in builtins:
            return builtins[name]
        if name in builtins.values():
            return name
        group = GROUPS[kind]
        installed = entry_points(group)
        if name in installed:
            return installed[name]
        if name in installed.values():
            return name
        if not REF.match(name):
            known = ", ".join([*builtins, *installed])
            raise SpecError(
                f"field `{field}`: {shorten(name)!r} is neither a built-in or installed name "
                f"({known}) nor `package.module:NAME`"
            )
        module = name.partition(":")[0]
        if self.allows_module(module):
            return name
        allowed = ", ".join(self.modules) or "none"
        raise SpecError(
            f"field `{field}`: module {shorten(module)!r} is not allowed here (allowed module "
            f"prefixes: {allowed}); name a built-in, an entry point of an installed package "
            f"(group `{group}`), or have the operator add its package to {self.setting}"
        )


@functools.cache
def entry_points(group: str) -> dict[str, str]:
    """Entry-point name -> `module:NAME` of every installed package's entry points in
    `group` (read once per process: installing a package means restarting the service)."""
    from importlib.metadata import entry_points as installed

    out: dict[str, str] = {}
    for ep in installed(group=group):
        if ep.attr and MODULE.match(ep.module):
            out[ep.name] = f"{ep.module}:{ep.attr}"
    return out


def load(target: str, field: str, what: str = "") -> Any:
    """The value `module:NAME` names, imported; any failure (SystemExit and
    KeyboardInterrupt included) is a SpecError naming `field` (`what`: the NAME's kind,
    as a missing one is named: `function `)."""
    module_name, _, attr = target.partition(":")
    try:
        value = getattr(importlib.import_module(module_name), attr, None)
    except BaseException as err:  # noqa: B036 - the user's module must not end the service
        raise SpecError(
            f"field `{field}`: cannot import module {shorten(module_name)!r} "
            f"({type(err).__name__}: {shorten(str(err))}); it must be importable on the "
            "learner's and the workers' Python path"
        ) from None
    if value is None:
        raise SpecError(f"field `{field}`: module {shorten(module_name)!r} has no "
                        f"{what}{attr!r}")
    return value


def guarded(field: str, doing: str, fn: Callable[[], T]) -> T:
    """`fn()`, user code: whatever it raises, SystemExit and KeyboardInterrupt included, is
    a SpecError naming `field` (a SpecError it raises passes as it is)."""
    try:
        return fn()
    except SpecError:
        raise
    except BaseException as err:  # noqa: B036 - user code must not end the service
        raise SpecError(
            f"field `{field}`: {doing} failed ({type(err).__name__}: {shorten(str(err))}); it "
            "must import and run on the learner and the workers"
        ) from None


def local_modules(directory: str | Path = ".") -> tuple[str, ...]:
    """The top-level modules and packages of `directory` (its `*.py` files and folders
    with a Python-identifier name): what `marl demo` and `marl up` allow, since the user
    who starts them there is the operator."""
    names = set()
    for entry in Path(directory).iterdir():
        name = entry.stem if entry.suffix == ".py" and entry.is_file() else entry.name
        if (entry.is_dir() or entry.suffix == ".py") and LOCAL_NAME.fullmatch(name):
            names.add(name)
    return tuple(sorted(names))[:MAX_MODULES]


def shorten(text: str, limit: int = 120) -> str:
    from marl.spec.safe_input import shorten as cut

    return cut(text, limit)
