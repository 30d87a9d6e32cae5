"""A bench's result as a snapshot: `--save` keeps its last JSON line in bench/results/.

Every bench ends by printing one JSON object with its figures (its last line, what scripts
and readers parse). `emit` prints that line and, when the bench was given `--save`, writes
`bench/results/<bench>-<UTC time>.json`:

    {"bench": "sandbox", "date": "2026-12-01 20:49", "command": "python bench/sandbox.py",
     "host": {"cpu": ..., "cpu_family": ..., "cpu_model": ..., "cores": 2, "flags": [...],
              "torch": "2.13.0"},
     "figures": {... the last JSON line ...}}

docs/benchmarks.md is generated from the newest snapshot of each bench and command
(scripts/gen_benchmarks_page.py), so a figure reaches the docs only with the command, host
and date it was measured with.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from host import host

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parent.parent
SAVE_FLAG = "--save"


def add_save_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(SAVE_FLAG, action="store_true",
                        help="also write the figures, with the date, host and command, to "
                        "bench/results/ (docs/benchmarks.md is generated from there)")  # fmt: skip


def torch_version() -> str | None:
    """torch's version where it is installed (every bench's venv has it; None elsewhere)."""
    try:
        import torch
    except ImportError:
        return None
    return str(torch.__version__)


def host_facts() -> dict[str, Any]:
    """What the figures depend on: CPU, cores, flags (bench/host.py) and torch's version."""
    return {**host(), "torch": torch_version()}


def host_description(facts: dict[str, Any] | None = None) -> str:
    """One line for a page: `AMD EPYC 9B14 (family 25 model 17), 2 cores, avx2; torch 2.13.0`."""
    f = facts if facts is not None else host_facts()
    parts = [str(f.get("cpu") or "CPU not recorded")]
    if f.get("cpu_family") not in (None, "?"):
        parts[0] += f" (family {f['cpu_family']} model {f.get('cpu_model', '?')})"
    if f.get("cores"):
        parts.append(f"{f['cores']} cores")
    if f.get("flags"):
        parts.append(", ".join(f["flags"]))
    if f.get("gpu"):
        parts.append(str(f["gpu"]))
    torch = f"torch {f['torch']}" if f.get("torch") else "torch not recorded"
    return ", ".join(parts) + f"; {torch}"


def command(argv: list[str] | None = None, executable: str | None = None) -> str:
    """The command line that reproduces the run, from the repository root, without --save:
    `python bench/e2e.py --steps 10` (`.venv-vllm/bin/python ...` from a venv of the repo
    other than .venv, whose `python` the docs assume)."""
    args = list(sys.argv if argv is None else argv)
    script = Path(args[0]).resolve()
    try:
        shown = str(script.relative_to(ROOT))
    except ValueError:
        shown = script.name
    python = Path(executable or sys.executable)
    interpreter = "python"
    if not python.is_relative_to(ROOT / ".venv"):
        try:
            interpreter = str(python.relative_to(ROOT))
        except ValueError:
            interpreter = "python"
    rest = [a for a in args[1:] if a != SAVE_FLAG]
    return shlex.join([interpreter, shown, *rest])


def snapshot(figures: dict[str, Any], argv: list[str] | None = None,
             now: dt.datetime | None = None, facts: dict[str, Any] | None = None,
             ) -> dict[str, Any]:  # fmt: skip
    when = now or dt.datetime.now(dt.UTC)
    args = list(sys.argv if argv is None else argv)
    return {
        "bench": Path(args[0]).stem,
        "date": when.strftime("%Y-%m-%d %H:%M"),
        "command": command(args),
        "host": facts if facts is not None else host_facts(),
        "figures": figures,
    }


def save(snap: dict[str, Any], results: Path = RESULTS) -> Path:
    """Write the snapshot as `<bench>-<YYYYmmddTHHMM>Z.json`; a second one in the same
    minute gets a suffix rather than replacing the first."""
    results.mkdir(parents=True, exist_ok=True)
    stem = f"{snap['bench']}-{snap['date'].replace('-', '').replace(' ', 'T').replace(':', '')}Z"
    path, n = results / f"{stem}.json", 1
    while path.exists():
        n += 1
        path = results / f"{stem}-{n}.json"
    path.write_text(json.dumps(snap, indent=1, sort_keys=False) + "\n")
    return path


def emit(figures: dict[str, Any], save_to: bool | Path, argv: list[str] | None = None) -> None:
    """Print `figures` as the bench's last line; with `save_to` (the bench's --save, or a
    results folder) also keep it as a snapshot, named on stderr so the last stdout line
    stays the JSON."""
    line = json.dumps(figures)
    if save_to:
        # the snapshot holds what the line says, types and all
        snap = snapshot(json.loads(line), argv)
        where = save(snap, save_to if isinstance(save_to, Path) else RESULTS)
        print(f"snapshot: {where}", file=sys.stderr)
    print(line, flush=True)
