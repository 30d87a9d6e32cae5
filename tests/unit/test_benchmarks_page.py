"""docs/benchmarks.md is generated from bench/results/, and every bench can write there."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from scripts import gen_benchmarks_page as page

ROOT = Path(__file__).resolve().parents[2]


def test_committed_page_equals_the_generated_one() -> None:
    assert page.PAGE.read_text() == page.render(), (
        "docs/benchmarks.md is stale: run python scripts/gen_benchmarks_page.py"
    )
    assert page.main(["--check"]) == 0


def test_every_snapshot_is_complete() -> None:
    snaps = page.load()
    assert snaps
    for s in snaps:
        assert (ROOT / "bench" / f"{s['bench']}.py").is_file(), s["_file"]
        assert s["_file"].startswith(f"{s['bench']}-"), s["_file"]
        assert f"bench/{s['bench']}.py" in s["command"], s["_file"]
        assert isinstance(s["figures"], dict) and s["figures"], s["_file"]
        assert "cores" in s["host"] and "torch" in s["host"], s["_file"]


def _write(root: Path, name: str, command: str, date: str, figures: dict[str, object]) -> None:
    snap = {"bench": "sampling", "date": date, "command": command,
            "host": {"cpu": "X", "cores": 2, "torch": "2.13.0"}, "figures": figures}  # fmt: skip
    (root / name).write_text(json.dumps(snap))


def test_the_page_shows_the_newest_snapshot_of_each_command(tmp_path: Path) -> None:
    _write(tmp_path, "sampling-1.json", "python bench/sampling.py", "2026-11-27", {"x": 1.0})
    _write(tmp_path, "sampling-2.json", "python bench/sampling.py", "2026-12-04 09:05",
           {"x": 2.0, "by": {"vocab": [1, 2]}})  # fmt: skip
    _write(tmp_path, "sampling-3.json", "python bench/sampling.py --rows 8", "2026-11-01",
           {"x": 3.0})  # fmt: skip
    text = page.render(tmp_path)
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert table[:7] == [
        "|  | `python bench/sampling.py` | `python bench/sampling.py --rows 8` |",
        "| --- | --- | --- |",
        "| host | X, 2 cores; torch 2.13.0 | X, 2 cores; torch 2.13.0 |",
        "| date (UTC) | 2026-12-04 09:05 | 2026-11-01 |",
        "| `by.vocab` | 1, 2 |  |",
        "| `x` | 2 | 3 |",
        "| bench | measures |",
    ]


def test_every_bench_takes_save_and_ends_with_emit() -> None:
    benches = [p for p in (ROOT / "bench").glob("*.py") if p.stem not in page.HELPERS]
    assert len(benches) >= 10
    for path in benches:
        tree = ast.parse(path.read_text())
        calls = {n.func.id for n in ast.walk(tree)
                 if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}  # fmt: skip
        assert {"add_save_option", "emit"} <= calls, f"{path.name}: call bench/snapshot.py"
