"""The committed stubs in marl/protocol/v1 are exactly what the pinned grpcio-tools generates."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_stubs_match_protos(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), str(tmp_path)],
        check=True,
        capture_output=True,
    )
    generated = sorted(p.name for p in (tmp_path / "marl" / "protocol" / "v1").glob("*_pb2*.py*"))
    committed = sorted(p.name for p in (ROOT / "marl" / "protocol" / "v1").glob("*_pb2*.py*"))
    assert generated == committed
    for name in generated:
        fresh = (tmp_path / "marl" / "protocol" / "v1" / name).read_text()
        assert fresh == (ROOT / "marl" / "protocol" / "v1" / name).read_text(), (
            f"marl/protocol/v1/{name} is stale: run `make protos`"
        )
