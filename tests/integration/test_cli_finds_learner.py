"""`marl up`, then the documented client commands with no `--learner`, as a user types them.

`marl up` (default `--dir marl-up`) runs as its own process in a scratch folder; `marl
submit`, `runs`, `status` and `cancel`, run in that folder, find its learner through
`./marl-up/endpoints.json`; run elsewhere, through the `export MARL_LEARNER=...` line
`marl up` printed. endpoints.json also names every service's Prometheus scrape URL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from marl.local.demo import DEMO_SPEC
from marl.models.demo import demo_model_dir


def marl(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "marl.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def up(tmp_path: Path) -> Iterator[dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if k != "MARL_LEARNER"}
    folder = tmp_path / "project"
    folder.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "marl.cli", "up"], cwd=folder, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 300
        assert proc.stdout is not None
        while not any(line.startswith("export MARL_LEARNER=") for line in lines):
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "".join(lines)
            lines.append(line)
        yield {"folder": folder, "env": env, "lines": lines,
               "endpoints": json.loads((folder / "marl-up" / "endpoints.json").read_text())}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow  # a whole `marl up` and seven CLI processes: about a minute on 2 cores
def test_commands_find_marl_ups_learner_without_flags(up: dict[str, Any], tmp_path: Path) -> None:
    folder, env, endpoints = up["folder"], up["env"], up["endpoints"]
    export = next(line for line in up["lines"] if line.startswith("export MARL_LEARNER="))
    assert export.strip() == f"export MARL_LEARNER={endpoints['learner']}"
    spec = {**DEMO_SPEC, "model": {"path": str(demo_model_dir())},
            "train": {**DEMO_SPEC["train"], "steps": 200}}
    (folder / "run.yaml").write_text(yaml.safe_dump(spec))

    submitted = marl("submit", "run.yaml", cwd=folder, env=env)
    assert submitted.returncode == 0, submitted.stderr
    run_id = submitted.stdout.strip()
    listed = marl("runs", cwd=folder, env=env)
    assert listed.returncode == 0 and run_id in listed.stdout, listed.stderr
    status = marl("status", run_id, "--json", cwd=folder, env=env)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["run_id"] == run_id

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    lost = marl("runs", cwd=elsewhere, env=env)  # no marl-up/ here, no $MARL_LEARNER
    assert lost.returncode == 2 and "no such file" in lost.stderr
    with_env = {**env, "MARL_LEARNER": export.strip().partition("=")[2]}
    assert run_id in marl("runs", cwd=elsewhere, env=with_env).stdout
    cancelled = marl("cancel", run_id, cwd=elsewhere, env=with_env)
    assert cancelled.returncode == 0 and run_id in cancelled.stdout, cancelled.stderr

    for kind in ("learner", "inference", "workflow", "sandbox"):
        (url,) = endpoints["metrics"][kind]
        reply = requests.get(url, timeout=10)
        assert reply.status_code == 200 and "marl_requests_total" in reply.text, kind
