"""Rendering the Helm chart with a real `helm` binary, for the chart tests."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm"
SCENARIOS = sorted((CHART / "ci").glob("*-values.yaml"))
NAMESPACE = "marl"
WORKLOADS = ("Deployment", "StatefulSet")


def helm_binary() -> str:
    """MARL_HELM, else the one scripts/get_deploy_tools.py extracts, else helm on PATH."""
    for candidate in (
        os.environ.get("MARL_HELM"),
        str(ROOT / ".cache" / "tools" / "helm"),
        shutil.which("helm"),
    ):
        if candidate and Path(candidate).is_file():
            return candidate
    pytest.skip("no helm binary: run `python scripts/get_deploy_tools.py helm` (make test-deploy)")


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=120)


def render(values: Path | None = None, *sets: str) -> list[dict[str, Any]]:
    args = ["template", "r", str(CHART), "--namespace", NAMESPACE]
    if values is not None:
        args += ["-f", str(values)]
    for s in sets:
        args += ["--set", s]
    out = helm(*args)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def render_text(values: Path | None = None) -> str:
    args = ["template", "r", str(CHART), "--namespace", NAMESPACE]
    if values is not None:
        args += ["-f", str(values)]
    out = helm(*args)
    assert out.returncode == 0, out.stderr
    return out.stdout


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def workloads(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] in WORKLOADS}


def scenario_id(values: Path | None) -> str:
    return "default" if values is None else values.name.removesuffix("-values.yaml")


ALL_VALUES: list[Path | None] = [None, *SCENARIOS]
