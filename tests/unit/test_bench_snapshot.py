"""bench/snapshot.py: a bench's `--save` keeps its last JSON line with date, host, command."""

from __future__ import annotations

import argparse
import datetime as dt
import json
from pathlib import Path

import pytest
import snapshot

ROOT = Path(__file__).resolve().parents[2]

FACTS = {"cpu": "AMD EPYC 9B14", "cpu_family": "25", "cpu_model": "17", "cores": 2,
         "flags": ["avx2", "avx512f"], "torch": "2.13.0"}  # fmt: skip
NOW = dt.datetime(2026, 12, 4, 9, 5, 31, tzinfo=dt.UTC)


def test_command_is_the_line_that_reruns_it_without_save() -> None:
    argv = [str(ROOT / "bench" / "e2e.py"), "--steps", "10", "--save", "--model", "smollm2"]
    python = str(ROOT / ".venv" / "bin" / "python")
    assert snapshot.command(argv, python) == "python bench/e2e.py --steps 10 --model smollm2"
    vllm = str(ROOT / ".venv-vllm" / "bin" / "python")
    assert snapshot.command([str(ROOT / "bench" / "inference.py"), "--engine", "vllm"], vllm) == (
        ".venv-vllm/bin/python bench/inference.py --engine vllm"
    )
    assert snapshot.command(["bench/sandbox.py", "--label", "a b"], "/usr/bin/python3") == (
        "python bench/sandbox.py --label 'a b'"
    )


def test_host_description_names_cpu_cores_flags_and_torch() -> None:
    assert snapshot.host_description(FACTS) == (
        "AMD EPYC 9B14 (family 25 model 17), 2 cores, avx2, avx512f; torch 2.13.0"
    )
    assert snapshot.host_description(
        {"cpu": None, "cores": 16, "gpu": "one NVIDIA H200", "torch": None}
    ) == (  # fmt: skip
        "CPU not recorded, 16 cores, one NVIDIA H200; torch not recorded"
    )
    facts = snapshot.host_facts()
    assert facts["cores"] >= 1 and facts["torch"]  # the venv's torch, whatever its version


def test_snapshot_holds_the_figures_with_date_command_and_host() -> None:
    snap = snapshot.snapshot({"speedup": 1.25}, [str(ROOT / "bench" / "sampling.py"), "--save"],
                             now=NOW, facts=FACTS)  # fmt: skip
    assert snap == {"bench": "sampling", "date": "2026-12-04 09:05",
                    "command": snapshot.command([str(ROOT / "bench" / "sampling.py")]),
                    "host": FACTS, "figures": {"speedup": 1.25}}  # fmt: skip


def test_save_names_by_bench_and_minute_and_never_overwrites(tmp_path: Path) -> None:
    snap = {"bench": "sampling", "date": "2026-12-04 09:05", "command": "python bench/x.py",
            "host": FACTS, "figures": {"a": 1}}  # fmt: skip
    first = snapshot.save(snap, tmp_path)
    second = snapshot.save({**snap, "figures": {"a": 2}}, tmp_path)
    assert first.name == "sampling-20261204T0905Z.json"
    assert second.name == "sampling-20261204T0905Z-2.json"
    assert json.loads(first.read_text())["figures"] == {"a": 1}
    assert json.loads(second.read_text())["figures"] == {"a": 2}


def test_emit_keeps_the_last_line_json_and_saves_only_when_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [str(ROOT / "bench" / "drift.py"), "--threads", "1", "--save"]
    snapshot.emit({"ratio": 0.5, "rows": [1, 2]}, False, argv)
    assert list(tmp_path.iterdir()) == []
    snapshot.emit({"ratio": 0.5, "rows": [1, 2]}, tmp_path, argv)
    out = capsys.readouterr()
    assert out.out.splitlines()[-1] == '{"ratio": 0.5, "rows": [1, 2]}'
    (saved,) = tmp_path.iterdir()
    assert saved.name in out.err
    snap = json.loads(saved.read_text())
    assert snap["bench"] == "drift"
    assert snap["command"] == snapshot.command(argv[:-1]).replace(" --save", "")
    assert snap["command"].endswith("bench/drift.py --threads 1")
    assert snap["figures"] == {"ratio": 0.5, "rows": [1, 2]}
    assert dt.datetime.strptime(snap["date"], "%Y-%m-%d %H:%M")
    assert snap["host"]["cores"] >= 1


def test_save_option_is_a_flag() -> None:
    ap = argparse.ArgumentParser()
    snapshot.add_save_option(ap)
    assert ap.parse_args(["--save"]).save is True
    assert ap.parse_args([]).save is False
