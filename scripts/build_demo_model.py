"""Rebuild the demo model that ships in `marl/assets/demo-model/`.

    python scripts/build_demo_model.py [--out DIR]

A tiny Qwen3 and its word-level tokenizer, warm-started by a fixed number of
supervised steps on one thread with deterministic kernels (`marl.models.demo`).
Another machine may round differently and end elsewhere, so the result is
committed and `marl demo` uses that copy: every machine starts the demo from the
same weights. Rebuild only when the demo's task, prompts or tokenizer change, then
re-measure the demo and update the README's table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from marl.models.demo import SHIPPED_DIR, build_demo_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=SHIPPED_DIR)
    args = parser.parse_args()
    info = build_demo_model(args.out)
    print(json.dumps(info))


if __name__ == "__main__":
    main()
