"""Which learner a client command talks to, and where that address came from.

In order: `--learner ADDR`, else `$MARL_LEARNER`, else the learner that `marl up`
wrote into `./marl-up/endpoints.json` (its default `--dir`), else 127.0.0.1:50051 (a
`kubectl port-forward svc/marl-learner 50051:50051`). When nothing answers there, the
error names the address, the source it came from and every source looked at, so a
user sees at once that, say, `marl up` ran in another folder.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from marl.spec.errors import UserError
from marl.spec.services import LOCAL_LEARNER

ENV = "MARL_LEARNER"
UP_ENDPOINTS = Path("marl-up") / "endpoints.json"
"""Relative to the working directory: where `marl up` (default `--dir marl-up`) writes."""
FALLBACK = LOCAL_LEARNER


@dataclass(frozen=True)
class LearnerAddress:
    address: str
    source: str
    """Where the address came from, as the user would name it (`--learner`, `$MARL_LEARNER`,
    `./marl-up/endpoints.json`, `the default`)."""
    tried: tuple[str, ...]
    """Every source looked at before it, with why it was passed over."""

    def explain(self) -> str:
        """For an error: where the address came from and what was looked at before it."""
        if self.source == "--learner":
            return "the address given with --learner"
        return (f"the address came from {self.source} (looked at: {'; '.join(self.tried)}); "
                f"`marl up` run here writes ./{UP_ENDPOINTS.as_posix()}, or export {ENV}=ADDR")


def resolve(flag: str | None, cwd: Path | None = None) -> LearnerAddress:
    """The learner's address for a command run in `cwd` (default: the working directory)."""
    if flag:
        return LearnerAddress(flag, "--learner", ())
    tried = ["--learner: not given"]
    env = os.environ.get(ENV, "").strip()
    if env:
        return LearnerAddress(env, f"${ENV}", tuple(tried))
    tried.append(f"${ENV}: not set")
    path = (cwd or Path.cwd()) / UP_ENDPOINTS
    shown = f"./{UP_ENDPOINTS.as_posix()}"
    if path.is_file():
        learner = _learner_in(path, shown)
        if learner:
            return LearnerAddress(learner, shown, tuple(tried))
        tried.append(f"{shown}: lists no learner")
    else:
        tried.append(f"{shown}: no such file")
    return LearnerAddress(FALLBACK, "the default", tuple(tried))


def _learner_in(path: Path, shown: str) -> str | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{shown}: not readable as `marl up`'s endpoints ({err}); remove it "
                        "or pass --learner ADDR") from None
    learner = data.get("learner") if isinstance(data, dict) else None
    return learner if isinstance(learner, str) and learner else None
