"""A finished (or running) run directory read back: metrics, saved transcripts, spec, alarms.

`marl report` reads everything from disk, so a run can be diagnosed long after its
services are gone; signatures are recomputed from the saved rollouts with the same
functions the learner would use, and alarms are re-evaluated over the merged records.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marl.diagnostics.alarms import Alarm, scan
from marl.diagnostics.signatures import parallel_roles, role_signatures
from marl.rollout import Rollout
from marl.spec.run import RunSpec, SpecError, load_spec_text

_STEP_FILE = re.compile(r"^step_(\d+)\.jsonl$")


@dataclass
class RunData:
    path: Path
    spec: RunSpec
    records: list[dict[str, Any]]
    """metrics.jsonl, one per logged step, with each step's `sig/<role>/...` merged in."""
    rollouts: dict[int, list[Rollout]] = field(default_factory=dict)
    """Saved transcripts by step."""
    alarms: list[Alarm] = field(default_factory=list)
    """Alarm onsets over the merged records, under the run's own thresholds."""
    logged_alarms: list[tuple[int, str]] = field(default_factory=list)
    """What the learner wrote to metrics.jsonl's `alarms` while the run went."""

    @property
    def shared(self) -> bool:
        groups = self.spec.policy_groups
        if groups is not None:
            return len(set(groups.values())) < len(groups)
        return self.spec.policy == "shared"


def read_records(path: Path) -> list[dict[str, Any]]:
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                raise ValueError(f"{path}:{n} is not a JSON line") from None
    return out


def read_rollouts(folder: Path) -> dict[int, list[Rollout]]:
    out: dict[int, list[Rollout]] = {}
    if folder.is_dir():
        for f in sorted(folder.iterdir()):
            m = _STEP_FILE.match(f.name)
            if m:
                out[int(m.group(1))] = [
                    Rollout.from_dict(json.loads(line))
                    for line in f.read_text().splitlines()
                    if line.strip()
                ]
    return out


def load_run(path: str | Path) -> RunData:
    """Read a run directory; a ValueError names what is missing."""
    run = Path(path)
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        raise ValueError(f"{run} is not a run directory: it has no metrics.jsonl")
    spec_file = run / "run.yaml"
    try:
        spec = load_spec_text(spec_file.read_text()) if spec_file.is_file() else RunSpec()
    except SpecError as err:
        raise ValueError(f"{spec_file}: {err}") from None
    records = read_records(metrics)
    rollouts = read_rollouts(run / "rollouts")
    by_step = {int(r["step"]): r for r in records}
    for step, rs in rollouts.items():
        sig = role_signatures(rs, spec.workflow)
        if step in by_step:  # the learner's own sig/ (over all the step's rollouts) wins
            by_step[step] = {**sig, **by_step[step]}
        else:
            by_step[step] = {"step": step, **sig}
    merged = [by_step[s] for s in sorted(by_step)]
    data = RunData(run, spec, merged, rollouts)
    data.alarms = scan(merged, spec.alarms, data.shared, parallel_roles(spec.workflow))
    data.logged_alarms = [(int(r["step"]), str(a)) for r in merged for a in r.get("alarms") or []]
    return data
