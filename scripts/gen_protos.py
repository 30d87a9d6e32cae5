"""Regenerate the committed gRPC stubs in marl/protocol/v1/ from proto/marl/v1/*.proto.

Uses the pinned grpcio-tools; imports are rewritten to be package-relative so the
stubs work from the installed `marl` package.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent


def generate(out_root: Path) -> list[Path]:
    """Write the stubs under OUT_ROOT/marl/protocol/v1/ (protoc names them by the proto's
    path, marl/v1/, and they import each other relatively, so they can live anywhere)."""
    protos = sorted((ROOT / "proto").rglob("*.proto"))
    target = out_root / "marl" / "protocol" / "v1"
    target.mkdir(parents=True, exist_ok=True)
    generated = []
    with tempfile.TemporaryDirectory() as scratch:
        args = [
            "grpc_tools.protoc",
            f"-I{ROOT / 'proto'}",
            f"--python_out={scratch}",
            f"--pyi_out={scratch}",
            f"--grpc_python_out={scratch}",
            *[str(p) for p in protos],
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        for path in sorted((Path(scratch) / "marl" / "v1").glob("*_pb2*.py*")):
            text = path.read_text()
            text = re.sub(r"^from marl\.v1 import (\w+)", r"from . import \1", text, flags=re.M)
            (target / path.name).write_text(text)
            generated.append(target / path.name)
    return generated


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    for p in generate(out):
        print(p.relative_to(out))
