"""TLS in the chart: with `tls.enabled` every pod mounts a certificate, every marl service
gets the MARL_TLS_* variables that make it serve TLS only and verify its peers, Redis
listens with TLS only behind a rediss:// URL, the sandbox holds a certificate of its own,
the certificates name what clients dial, and the probes check health over TLS (a probe
script run here against a real TLS gRPC server)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tests.support.chart import CHART, by_kind, helm, render, workloads

TLS = CHART / "ci" / "tls-values.yaml"
MARL_SERVICES = ("inference", "workflow", "learner", "sandbox")
MOUNT = "/etc/marl-tls"
EXISTING = [
    "tls.enabled=true",
    "tls.existingSecret=marl-tls",
    "tls.sandboxExistingSecret=marl-sandbox-tls",
]


def pod(doc: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = doc["spec"]["template"]["spec"]
    return spec


def env(doc: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod(doc)["containers"]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def tls_secret(doc: dict[str, Any]) -> str:
    """The Secret the pod mounts at MOUNT (read-only)."""
    spec = pod(doc)
    (container,) = spec["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == MOUNT]
    assert mount["readOnly"] is True
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    name: str = volume["secret"]["secretName"]
    return name


@pytest.mark.parametrize(
    ("sets", "shared", "sandbox"),
    [([], "r-marl-tls", "r-marl-sandbox-tls"), (EXISTING, "marl-tls", "marl-sandbox-tls")],
    ids=["cert-manager", "existing-secrets"],
)
def test_every_pod_mounts_a_certificate_and_every_service_sets_marl_tls(
    sets: list[str], shared: str, sandbox: str
) -> None:
    docs = workloads(render(TLS if not sets else None, *sets))
    assert set(docs) == {f"r-marl-{c}" for c in (*MARL_SERVICES, "redis")}
    for name, doc in docs.items():
        assert tls_secret(doc) == (sandbox if name == "r-marl-sandbox" else shared), name
    for service in MARL_SERVICES:
        got = env(docs[f"r-marl-{service}"])
        assert got["MARL_TLS_CERT"] == f"{MOUNT}/tls.crt"
        assert got["MARL_TLS_KEY"] == f"{MOUNT}/tls.key"
        if service == "sandbox":  # serves only; it calls no one and so verifies no one
            assert "MARL_TLS_CA" not in got and "MARL_TLS_SERVER_NAME" not in got
        else:
            assert got["MARL_TLS_CA"] == f"{MOUNT}/ca.crt"
            assert got["MARL_TLS_SERVER_NAME"] == "r-marl.marl.svc"
    for service in ("inference", "workflow", "learner"):
        url = env(docs[f"r-marl-{service}"])[f"MARL_{service.upper()}_REDIS"]
        assert url.startswith("rediss://") and url.endswith(f"?ssl_ca_certs={MOUNT}/ca.crt")
    args = pod(docs["r-marl-redis"])["containers"][0]["args"]
    flags = dict(zip(args[::2], args[1::2], strict=True))
    assert flags["--port"] == "0" and flags["--tls-port"] == "6379"  # no plaintext port
    assert flags["--tls-cert-file"] == f"{MOUNT}/tls.crt"


def test_without_tls_no_pod_mounts_a_certificate() -> None:
    for name, doc in workloads(render()).items():
        assert "MARL_TLS_CERT" not in env(doc), name
        assert all(v["name"] != "tls" for v in pod(doc)["volumes"]), name
        assert "rediss://" not in str(env(doc)), name


def test_the_certificates_name_what_clients_dial() -> None:
    docs = render(TLS)
    certs = by_kind(docs, "Certificate")
    shared, sandbox = certs["r-marl-tls"]["spec"], certs["r-marl-sandbox-tls"]["spec"]
    assert shared["secretName"] == "r-marl-tls" and sandbox["secretName"] == "r-marl-sandbox-tls"
    for spec in (shared, sandbox):
        assert spec["issuerRef"] == {
            "name": "marl-ca",
            "kind": "ClusterIssuer",
            "group": "cert-manager.io",
        }
    # a server dialled at its pod IP is checked against the server name
    assert "r-marl.marl.svc" in shared["dnsNames"]
    for service in by_kind(docs, "Service"):
        component = service.removeprefix("r-marl-")
        if component in ("redis", "inference", "workflow", "learner"):
            assert {service, f"{service}.marl.svc", f"{service}.marl.svc.cluster.local"} <= set(
                shared["dnsNames"]
            ), service
    # KEDA dials Redis by its namespaced name
    address = by_kind(docs, "ScaledObject")["r-marl-workflow"]["spec"]["triggers"][0]["metadata"][
        "address"
    ]
    assert address.removesuffix(":6379") in shared["dnsNames"]
    # the sandbox's key opens nothing else
    assert all(n.startswith("r-marl-sandbox") or n == "localhost" for n in sandbox["dnsNames"])
    workflow_config = by_kind(docs, "ConfigMap")["r-marl-workflow"]["data"]["workflow.yaml"]
    assert "sandbox: r-marl-sandbox:50054" in workflow_config
    assert "r-marl-sandbox" in sandbox["dnsNames"]


def test_keda_reaches_redis_over_tls_with_the_ca() -> None:
    docs = render(TLS)
    (trigger,) = by_kind(docs, "ScaledObject")["r-marl-workflow"]["spec"]["triggers"]
    assert trigger["type"] == "redis-streams" and trigger["metadata"]["enableTLS"] == "true"
    refs = by_kind(docs, "TriggerAuthentication")["r-marl-workflow"]["spec"]["secretTargetRef"]
    assert {"parameter": "ca", "name": "r-marl-tls", "key": "ca.crt"} in refs
    assert {"parameter": "password", "name": "r-marl-auth", "key": "token"} in refs


def test_prometheus_scrapes_over_tls() -> None:
    docs = render(
        CHART / "ci" / "autoscaling-values.yaml",
        "tls.enabled=true",
        "tls.certManager.enabled=true",
        "tls.certManager.issuerRef.name=ca",
    )
    for component in ("workflow", "inference"):
        doc = workloads(docs)[f"r-marl-{component}"]
        assert doc["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scheme"] == (
            "https"
        )
        (endpoint,) = by_kind(docs, "PodMonitor")[f"r-marl-{component}"]["spec"][
            "podMetricsEndpoints"
        ]
        assert endpoint["scheme"] == "https"
        assert endpoint["tlsConfig"] == {
            "serverName": "r-marl.marl.svc",
            "ca": {"secret": {"name": "r-marl-tls", "key": "ca.crt"}},
        }


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["tls.enabled=true"], "tls.enabled needs tls.existingSecret"),
        (["tls.enabled=true", "tls.existingSecret=x"], "tls.sandboxExistingSecret is required"),
        (
            ["tls.enabled=true", "tls.certManager.enabled=true"],
            "tls.certManager.issuerRef.name is required",
        ),
        (["tls.certManager.duration=90 days"], "tls.certManager.duration: Does not match"),
    ],
)
def test_tls_without_a_certificate_is_refused(sets: list[str], message: str) -> None:
    args = ["template", "r", str(CHART)]
    for s in sets:
        args += ["--set", s]
    out = helm(*args)
    assert out.returncode != 0
    assert message in out.stderr, out.stderr
    ok = render(None, "tls.enabled=true", "tls.existingSecret=x", "sandbox.enabled=false")
    assert "r-marl-sandbox" not in workloads(ok)


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA and a certificate for the chart's server name only (as in tls-values)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI")
    d = tmp_path_factory.mktemp("tls")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl(
        "req",
        "-x509",
        *ec,
        "-days",
        "1",
        "-keyout",
        str(d / "ca.key"),
        "-out",
        str(d / "ca.crt"),
        "-subj",
        "/CN=test CA",
    )
    _openssl(
        "req",
        *ec,
        "-keyout",
        str(d / "tls.key"),
        "-out",
        str(d / "tls.csr"),
        "-subj",
        "/CN=r-marl.marl.svc",
    )
    (d / "ext").write_text("subjectAltName=DNS:r-marl.marl.svc\n")
    _openssl(
        "x509",
        "-req",
        "-in",
        str(d / "tls.csr"),
        "-CA",
        str(d / "ca.crt"),
        "-CAkey",
        str(d / "ca.key"),
        "-CAcreateserial",
        "-days",
        "1",
        "-out",
        str(d / "tls.crt"),
        "-extfile",
        str(d / "ext"),
    )
    return d


def test_the_probes_check_health_over_tls(certs: Path) -> None:
    """The kubelet's gRPC probe speaks no TLS: with TLS every probe of a marl service is a
    script. Run the rendered one against a TLS health server: it passes on SERVING only."""
    docs = workloads(render(TLS))
    for service in MARL_SERVICES:
        (container,) = pod(docs[f"r-marl-{service}"])["containers"]
        for kind in ("readinessProbe", "livenessProbe"):
            assert "grpc" not in container[kind], (service, kind)
            command = container[kind]["exec"]["command"]
            # an empty environment but PATH: a job could read the probe's (the sandbox's)
            assert command[:2] == ["env", "-i"], (service, kind)
            assert command[2].startswith("PATH=") and "$" not in command[2]
            assert command[3:5] == ["python", "-c"], (service, kind)
    (container,) = pod(docs["r-marl-workflow"])["containers"]
    rendered = container["readinessProbe"]["exec"]["command"]
    script = rendered[5]
    assert "127.0.0.1:50053" in script and "r-marl.marl.svc" in script

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    status = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(status, server)
    key, cert = (certs / "tls.key").read_bytes(), (certs / "tls.crt").read_bytes()
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, cert)]))
    server.start()
    probe = script.replace(MOUNT, str(certs)).replace("127.0.0.1:50053", f"127.0.0.1:{port}")
    wrong_name = probe.replace("r-marl.marl.svc", "r-marl-sandbox")

    def passes(code: str) -> bool:
        """Run as the kubelet would: the rendered command, this Python first on its PATH,
        in an environment that holds a secret the probe must not pass on."""
        path = f"PATH={Path(sys.executable).parent}:{rendered[2].removeprefix('PATH=')}"
        out = subprocess.run([*rendered[:2], path, *rendered[3:5], code], capture_output=True,
                             timeout=30, env={"MARL_AUTH_TOKEN": "must-not-pass"})
        return out.returncode == 0

    try:
        status.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        not_serving = passes(probe)
        status.set("", health_pb2.HealthCheckResponse.SERVING)
        serving, other_name = passes(probe), passes(wrong_name)
    finally:
        server.stop(0)
    assert (not_serving, serving, other_name) == (False, True, False)
    path = f"PATH={Path(sys.executable).parent}:{rendered[2].removeprefix('PATH=')}"
    seen = subprocess.run([*rendered[:2], path, *rendered[3:5], "import os; print(dict(os.environ))"],
                          capture_output=True, text=True, timeout=30,
                          env={"MARL_AUTH_TOKEN": "must-not-pass", "PATH": "/usr/bin:/bin"})
    assert seen.returncode == 0 and "must-not-pass" not in seen.stdout, seen
