"""`marl cluster` against a Kubernetes API on loopback serving recorded responses."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import redis

from marl.cli import main as cli
from marl.cli.cluster import ClusterError, parse_xinfo_groups
from marl.local.redis_server import redis_server_binary
from marl.runtime import streams
from tests.support.fake_kube import FakeKube


@pytest.fixture()
def kube(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeKube]:
    with FakeKube() as fake:
        monkeypatch.setenv("KUBECONFIG", str(fake.kubeconfig(tmp_path / "kubeconfig")))
        yield fake


def test_status_counts_ready_pods_per_service_and_reads_the_lag(
    kube: FakeKube, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["cluster", "status", "--release", "r", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["namespace"] == "marl"  # from the kubeconfig context
    ready = {s: (v["ready"], len(v["pods"])) for s, v in out["services"].items()}
    assert ready == {
        "inference": (1, 1),
        "workflow": (1, 2),
        "sandbox": (1, 1),
        "learner": (1, 1),
        "redis": (1, 1),
    }
    assert out["services"]["learner"]["pods"][0]["restarts"] == 1
    assert out["tasks"] == {"waiting": 7, "pending": 3, "consumers": 2}
    # the pod list was asked for by the chart's labels, and the lag came from an exec in Redis
    selectors = [q.get("labelSelector") for m, p, q in kube.requests if p.endswith("/pods")]
    assert "app.kubernetes.io/part-of=marl,app.kubernetes.io/instance=r" in selectors
    (exec_query,) = [q for m, p, q in kube.requests if p.endswith("/exec")]
    assert exec_query["container"] == "redis"
    assert exec_query["command"][:2] == ["sh", "-c"]
    assert exec_query["command"][2].endswith("XINFO GROUPS marl:tasks")


def test_status_text(kube: FakeKube, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["cluster", "status", "--release", "r"]) == 0
    out = capsys.readouterr().out
    assert "workflow   1/2 ready" in out
    assert "r-marl-workflow-6f7c-bbbbb  Pending  NOT READY" in out
    assert "7 waiting, 3 pending on 2 workers" in out


def test_scale_patches_the_deployment_scale(
    kube: FakeKube, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["cluster", "scale", "workflow", "8", "--release", "r"]) == 0
    assert "r-marl-workflow: scaled to 8 replicas" in capsys.readouterr().out
    patches = [(p, b) for m, p, b in kube.requests if m == "PATCH"]
    assert patches == [
        (
            "/apis/apps/v1/namespaces/marl/deployments/r-marl-workflow/scale",
            {"spec": {"replicas": 8}},
        )
    ]


def test_scale_refuses_a_deployment_an_autoscaler_owns(
    kube: FakeKube, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["cluster", "scale", "sandbox", "3", "--release", "r"]) == 2
    err = capsys.readouterr().err
    assert "managed by the autoscaler r-marl-sandbox (2-16 replicas)" in err
    assert not [m for m, _, _ in kube.requests if m == "PATCH"]


def test_logs_prefix_each_line_with_its_pod(
    kube: FakeKube, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["cluster", "logs", "workflow", "--tail", "3", "--release", "r"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # two workflow pods; the recorded log is served for both, tailed by the server
    assert len(lines) == 6
    assert (
        lines[0] == "[r-marl-workflow-6f7c-aaaaa] 2026-11-23 07:00:07 workflow INFO episode 7 done"
    )
    tails = [q["tailLines"] for m, p, q in kube.requests if p.endswith("/log")]
    assert tails == ["3", "3"]


def test_user_errors_exit_2_naming_the_problem(
    kube: FakeKube, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["cluster", "scale", "workflow", "2", "--release", "nope"]) == 2
    assert "no workflow Deployment of release 'nope'" in capsys.readouterr().err
    assert cli.main(["cluster", "status", "-n", "nope", "--release", "r"]) == 2
    assert "refused (404)" in capsys.readouterr().err
    assert cli.main(["cluster", "scale", "workflow", "-1"]) == 2
    assert "replicas: must be >= 0" in capsys.readouterr().err
    bad = tmp_path / "bad-kubeconfig"
    bad.write_text("{}")
    assert cli.main(["cluster", "status", "--kubeconfig", str(bad)]) == 2
    assert "--kubeconfig" in capsys.readouterr().err


def test_wrong_token_is_refused(kube: FakeKube, capsys: pytest.CaptureFixture[str]) -> None:
    kube.token = "rotated"
    assert cli.main(["cluster", "status", "--release", "r"]) == 2
    assert "refused (401)" in capsys.readouterr().err


def test_unreachable_api(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with FakeKube() as fake:
        path = fake.kubeconfig(tmp_path / "kubeconfig")
    monkeypatch.setenv("KUBECONFIG", str(path))  # the server is gone now
    assert cli.main(["cluster", "status"]) == 2
    assert "cannot reach the Kubernetes API" in capsys.readouterr().err


def test_parse_xinfo_without_the_group_or_stream() -> None:
    assert parse_xinfo_groups("ERR no such key\n").lag.waiting == 0
    group = parse_xinfo_groups("name\nother\nconsumers\n1\npending\n0\n")
    assert group.lag.waiting is None and group.lag.consumers == 0
    assert group.last_delivered is None
    with pytest.raises(ClusterError, match="NOAUTH"):
        parse_xinfo_groups("NOAUTH Authentication required.\n")


def test_status_counts_the_undelivered_tasks_where_the_group_reports_no_lag(
    kube: FakeKube,
    redis_url: str,
    noscript_url: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Redis 6.2 (the one here) reports no lag, and Redis 7 none once the learner deleted
    tasks past the group's last delivery. The undelivered tasks are then counted in Redis:
    through redis-cli in the Redis pod (here a shell on this machine whose redis-cli reaches
    a real Redis), or through --redis, where an ACL without EVAL reads them instead."""
    r = redis.Redis.from_url(redis_url)
    r.xgroup_create(streams.TASKS, streams.WORKERS_GROUP, id="0", mkstream=True)
    ids = [r.xadd(streams.TASKS, {"json": "{}"}) for _ in range(10)]
    held: Any = r.xreadgroup(streams.WORKERS_GROUP, "w1", {streams.TASKS: ">"}, count=3)
    r.xack(streams.TASKS, streams.WORKERS_GROUP, held[0][1][0][0])
    r.xdel(streams.TASKS, ids[8], ids[9])  # deleted past the last delivery, as the learner does
    expected = {"waiting": 5, "pending": 2, "consumers": 1}

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    cli_path = Path(redis_server_binary()).with_name("redis-cli")
    (bin_dir / "redis-cli").write_text(
        f'#!/bin/sh\nexec {cli_path} -p {urlparse(redis_url).port} "$@"\n'
    )
    (bin_dir / "redis-cli").chmod(0o755)
    pod_env = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    kube.exec_runner = lambda command: subprocess.run(
        command, env=pod_env, capture_output=True, text=True, timeout=30, check=True
    ).stdout

    assert cli.main(["cluster", "status", "--release", "r", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tasks"] == expected
    commands = [q["command"][2] for m, p, q in kube.requests if p.endswith("/exec")]
    assert commands[0].endswith("XINFO GROUPS marl:tasks") and " EVAL " in commands[1]
    for url in (redis_url, noscript_url):
        assert cli.main(["cluster", "status", "--release", "r", "--redis", url, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["tasks"] == expected
    assert cli.main(["cluster", "status", "--release", "r"]) == 0
    assert "5 waiting, 2 pending on 1 workers" in capsys.readouterr().out
