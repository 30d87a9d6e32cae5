"""The sandbox server's settings, defined with every other service's in `marl.spec.services`.

Kept as a module so the sandbox's own code and tests import its settings from
next door; the model itself lives in one place so `marl serve sandbox
--config`, `MARL_SANDBOX_*` variables and the Helm chart's `sandbox.config`
values all validate against the same fields. `load_config(None)` gives the
defaults (plus any `MARL_SANDBOX_*` variables); a bad file is a `ValueError`
that names the field.
"""

from __future__ import annotations

from marl.spec.services import MiB, SandboxConfig, load_sandbox

__all__ = ["MiB", "SandboxConfig", "load_config"]


def load_config(path: str | None) -> SandboxConfig:
    return load_sandbox(path)
