"""`marl watch RUN`: a run's numbers live in the terminal, with the role drift alarms.

RUN is a run id (followed through the learner's `WatchRun` stream) or a run directory
(its `metrics.jsonl` followed on disk, so a run can be watched from any machine that
mounts it, and a finished one replayed). Either way the screen is one `rich` layout:
progress and the last reward/validation numbers, a per-role table with the signals the
paper reads per role (χ² and training perplexity over their first value, entropy, gradient
share, length and signatures), and every alarm as it fires. Alarms are the learner's
own (`metrics.jsonl` `alarms`) plus, for a directory, those recomputed under the run's
thresholds, so a run recorded before alarms existed still shows them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from marl.diagnostics.alarms import AlarmWatch, chi2_noise
from marl.diagnostics.signatures import parallel_roles
from marl.spec.run import AlarmSpec, RunSpec, SpecError, load_spec_text

Record = dict[str, Any]

COLUMNS = (
    ("chi2_token", "χ²/first", True),
    ("update_chi2", "moved χ²/first", True),
    ("training_ppl", "ppl/first", True),
    ("entropy", "entropy", False),
    ("grad_share", "grad share", False),
    ("response_len_p50", "len p50", False),
    ("truncation_rate", "trunc", False),
    ("boxed_rate", "boxed", False),
)
"""role/<role>/<key> columns; True: shown over the role's first logged value (Fig. 6)."""

SIG_COLUMNS = (("terse_rate", "terse"), ("jaccard3", "jaccard3"), ("hedging_rate", "hedge"))
"""sig/<role>/<key> columns, where the learner logs signatures."""


class WatchState:
    """Everything the screen shows, updated one metrics record at a time."""

    def __init__(self, spec: RunSpec | None, total: int):
        self.total = total
        self.records: list[Record] = []
        self.first: dict[str, float] = {}
        self.floor = (spec.alarms if spec is not None else AlarmSpec()).chi2_noise_floor
        """`alarms.chi2_noise_floor`: a χ²_token within it is shown as noise, not a ratio."""
        self.alarms: list[str] = []
        self.state = "RUNNING"
        self._watch = (
            AlarmWatch(
                spec.alarms,
                shared=_shared(spec),
                parallel=parallel_roles(spec.workflow),
            )
            if spec is not None
            else None
        )

    def add(self, record: Record) -> None:
        if "step" not in record:
            return
        self.records.append(record)
        if self.total and int(record["step"]) >= self.total and self.state == "RUNNING":
            self.state = "DONE"
        for k, v in record.items():
            if isinstance(v, int | float) and not isinstance(v, bool) and v > 0:
                self.first.setdefault(k, float(v))
        seen = set(self.alarms)
        for a in record.get("alarms") or []:
            text = f"step {record['step']}: {a}"
            if text not in seen:
                self.alarms.append(text)
        if self._watch is not None:
            for alarm in self._watch.update(record):
                text = f"step {alarm.step}: {alarm}"
                if not any(str(alarm) in s for s in self.alarms):
                    self.alarms.append(text)

    def latest(self, key: str) -> float | None:
        for r in reversed(self.records):
            v = r.get(key)
            if isinstance(v, int | float):
                return float(v)
        return None

    def roles(self) -> list[str]:
        return sorted(
            {k.split("/")[1] for r in self.records for k in r if k.startswith(("role/", "sig/"))}
        )

    def render(self) -> RenderableType:
        step = int(self.records[-1]["step"]) if self.records else 0
        head = Table.grid(padding=(0, 2))
        head.add_row(
            Text(f"step {step}/{self.total}", style="bold"),
            ProgressBar(total=max(self.total, 1), completed=step, width=40),
            Text(self.state, style="green" if self.state != "FAILED" else "red"),
        )
        numbers = []
        for key, label in (
            ("train/reward_mean", "reward"),
            ("train/accuracy", "train acc"),
            ("val/accuracy", "VAL ACC"),
            ("time/step_s", "s/step"),
        ):
            v = self.latest(key)
            if v is not None:
                numbers.append(f"{label} {v:.3f}")
        table = Table(title="per role", title_justify="left")
        table.add_column("role")
        cols = [(f"role/{{}}/{k}", label, norm) for k, label, norm in COLUMNS] + [
            (f"sig/{{}}/{k}", label, False) for k, label in SIG_COLUMNS
        ]
        shown = [
            c for c in cols if any(self.latest(c[0].format(r)) is not None for r in self.roles())
        ]
        for _, label, _ in shown:
            table.add_column(label, justify="right")
        noise = chi2_noise(self.records, self.floor)
        for role in self.roles():
            cells = []
            for pattern, _, norm in shown:
                key = pattern.format(role)
                v = self.latest(key)
                if v is None:
                    cells.append("")
                elif noise and key.endswith("/chi2_token"):
                    cells.append("noise")  # within alarms.chi2_noise_floor: no ratio
                elif norm and key in self.first:
                    cells.append(f"{v / self.first[key]:.2f}x")
                else:
                    cells.append(f"{v:.3g}")
            table.add_row(role, *cells)
        alarms = Text(
            "\n".join(self.alarms) or "no alarms", style="bold red" if self.alarms else "dim"
        )
        return Group(head, Text("  ".join(numbers)), table, Text("alarms:", style="bold"), alarms)


def _shared(spec: RunSpec) -> bool:
    if spec.policy_groups is not None:
        return len(set(spec.policy_groups.values())) < len(spec.policy_groups)
    return spec.policy == "shared"


def _read_spec(run_dir: Path) -> RunSpec | None:
    f = run_dir / "run.yaml"
    if not f.is_file():
        return None
    try:
        return load_spec_text(f.read_text())
    except SpecError as err:
        raise ValueError(f"{f}: {err}") from None


def tail_records(path: Path, follow: bool, interval: float = 1.0) -> Iterator[Record]:
    """Each complete JSON line of `path` as it is written; stops at the end unless `follow`."""
    offset = 0
    while True:
        if path.is_file():
            with path.open() as f:
                f.seek(offset)
                while True:
                    line = f.readline()
                    if not line.endswith("\n"):
                        break  # a line still being written: read it whole next time
                    offset += len(line.encode())
                    if line.strip():
                        yield json.loads(line)
        if not follow:
            return
        time.sleep(interval)


def show(state: WatchState, records: Iterable[Record], console: Console | None = None) -> None:
    """Redraw the screen after every record (plain lines when not a terminal)."""
    console = console or Console()
    with Live(state.render(), console=console, auto_refresh=False) as live:
        for record in records:
            state.add(record)
            live.update(state.render(), refresh=True)
        live.update(state.render(), refresh=True)  # the final state comes without a record


def watch_dir(run_dir: str | Path, follow: bool = True, console: Console | None = None) -> int:
    path = Path(run_dir)
    if not (path / "metrics.jsonl").is_file() and not (path / "run.yaml").is_file():
        raise ValueError(f"{path} is not a run directory: it has no metrics.jsonl or run.yaml")
    spec = _read_spec(path)
    state = WatchState(spec, spec.train.steps if spec is not None else 0)
    records = tail_records(path / "metrics.jsonl", follow)
    if follow:
        records = _until_done(records, state)
    show(state, records, console)
    return 0


def _until_done(records: Iterable[Record], state: WatchState) -> Iterator[Record]:
    for r in records:
        yield r
        if state.state != "RUNNING":
            return


def watch_run(stub: Any, run_id: str, console: Console | None = None) -> str:
    """Follow a run through the learner's WatchRun stream; return its final state."""
    from marl.protocol.v1 import learner_pb2

    state = WatchState(None, 0)

    def records() -> Iterator[Record]:
        req = learner_pb2.WatchRunRequest(run_id=run_id, from_start=True)
        for event in stub.WatchRun(req):
            state.state = event.run.state
            state.total = event.run.total_steps
            if state._watch is None and event.run.out_dir:
                spec = _read_spec(Path(event.run.out_dir))
                if spec is not None:
                    state._watch = AlarmWatch(
                        spec.alarms, _shared(spec), parallel_roles(spec.workflow)
                    )
            if event.metrics_json:
                yield json.loads(event.metrics_json)

    show(state, records(), console)
    return state.state
