"""Driving the built images through the `docker` SDK: Docker's API, or podman's copy of it.

With DOCKER_HOST set (a Docker daemon, or any podman socket) the tests use it
as is. Otherwise they start `podman system service` on a private socket with
scripts/podman_env.sh's settings, so the same tests run on a CI runner with
only Debian's podman installed. Every container runs on the host network
(the tests reach them on 127.0.0.1) with an init process, and is removed at
the end whatever happened.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from marl.runtime.serving import wait_healthy

ROOT = Path(__file__).resolve().parents[2]
TAG = os.environ.get("MARL_IMAGE_TAG") or yaml.safe_load(
    (ROOT / "deploy" / "helm" / "Chart.yaml").read_text())["appVersion"]
"""What `make images` tags its images with: the chart's appVersion unless TAG was given."""


def image(service: str) -> str:
    return f"localhost/marl-{service}:{TAG}"


@contextmanager
def container_engine() -> Iterator[Any]:
    docker = pytest.importorskip("docker")
    if os.environ.get("DOCKER_HOST"):
        client = docker.from_env()
        yield client
        client.close()
        return
    if shutil.which("podman") is None:
        pytest.skip("no DOCKER_HOST and no podman: apt-get install podman buildah runc")
    root = Path(
        os.environ.get("MARL_PODMAN_ROOT", f"{os.environ.get('TMPDIR', '/tmp')}/marl-podman")
    )
    root.mkdir(parents=True, exist_ok=True)
    sock = root / f"api-{os.getpid()}.sock"
    proc = subprocess.Popen(
        [
            "bash",
            "-c",
            f'source scripts/podman_env.sh && exec podman system service --time=0 "unix://{sock}"',
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while not sock.exists():
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("podman system service did not start")
            time.sleep(0.1)
        client = docker.DockerClient(base_url=f"unix://{sock}", timeout=120)
        yield client
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        sock.unlink(missing_ok=True)


def require_images(client: Any, *services: str) -> None:
    import docker

    for service in services:
        try:
            client.images.get(image(service))
        except docker.errors.ImageNotFound:
            pytest.skip(f"{image(service)} is not built: run `make images`")



class Containers:
    """Containers started for one test; `stop_all` removes them and keeps their logs."""

    def __init__(self, client: Any):
        self.client = client
        self.running: list[Any] = []
        self.logs: dict[str, str] = {}

    def run(self, image_name: str, command: list[str], name: str, **kw: Any) -> Any:
        ctr = self.client.containers.run(
            image_name,
            command,
            name=f"marl-test-{name}-{os.getpid()}",
            network_mode="host",
            init=True,
            detach=True,
            **kw,
        )
        self.running.append(ctr)
        return ctr

    def stop_all(self) -> None:
        for ctr in reversed(self.running):
            try:
                self.logs[ctr.name] = ctr.logs().decode(errors="replace")[-3000:]
                ctr.stop(timeout=5)
            finally:
                ctr.remove(force=True)
        self.running.clear()

    def describe(self) -> str:
        for ctr in self.running:
            self.logs[ctr.name] = ctr.logs().decode(errors="replace")[-3000:]
        return "\n".join(f"--- {k}\n{v}" for k, v in self.logs.items())


def wait_serving(address: str, containers: Containers, timeout: float = 180.0) -> None:
    try:
        asyncio.run(wait_healthy(address, timeout=timeout))
    except TimeoutError:
        raise AssertionError(f"{address} never reported SERVING\n{containers.describe()}") from None
