"""Optional TLS: with `$MARL_TLS_CERT`/`$MARL_TLS_KEY` every service serves gRPC and HTTP
over TLS only, and with `$MARL_TLS_CA` every marl client verifies it; with the token too,
a one-step run trains. A self-signed certificate for 127.0.0.1 is made with openssl."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import grpc
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc

import marl
from marl.clients.runs import RunsClient
from marl.local.demo import DEMO_SPEC
from marl.runtime import auth
from marl.spec.run import apply_overrides, dump_spec, parse_spec
from tests.support.cluster import ClusterFactory

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
TOKEN = "tls-test-token"


@pytest.fixture(scope="module")
def endpoints(
    module_clusters: ClusterFactory, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """The module's cluster, every service given a self-signed certificate for 127.0.0.1,
    and "ca": the certificate its clients verify against."""
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem"),
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    env = {"MARL_TLS_CERT": str(d / "cert.pem"), "MARL_TLS_KEY": str(d / "key.pem"),
           "MARL_TLS_CA": str(d / "cert.pem"), "MARL_AUTH_TOKEN": TOKEN}
    return {**module_clusters(env=env).endpoints(), "ca": env["MARL_TLS_CA"]}


def first(endpoints: dict[str, Any], key: str) -> str:
    found = endpoints[key]
    return str(found if isinstance(found, str) else found[0])


@pytest.mark.parametrize("kind", ["inference", "workflow", "learner", "sandbox"])
def test_grpc_is_tls_only(endpoints: dict[str, Any], kind: str) -> None:
    request = health_pb2.HealthCheckRequest()
    with grpc.insecure_channel(first(endpoints, kind)) as plain, pytest.raises(grpc.RpcError):
        health_pb2_grpc.HealthStub(plain).Check(request, timeout=5)
    with auth.channel(first(endpoints, kind)) as tls:
        status = health_pb2_grpc.HealthStub(tls).Check(request, timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_http_is_tls_only(endpoints: dict[str, Any]) -> None:
    address = first(endpoints, "inference_http")
    headers = {"Authorization": f"Bearer {TOKEN}"}
    assert requests.get(f"https://{address}/v1/models", headers=headers, timeout=10,
                        verify=endpoints["ca"]).ok
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://{address}/v1/models", headers=headers, timeout=10)


def test_one_step_run_over_tls(endpoints: dict[str, Any], tmp_path: Path) -> None:
    spec = parse_spec(apply_overrides(DEMO_SPEC, [
        "train.steps=1", "train.problems_per_step=2", "grpo.group_size=2",
        "train.val_problems=2", "train.step_timeout_s=120"]))
    spec.model.path = str(Path(marl.__file__).parent / "assets" / "demo-model")
    spec.out_dir = str(tmp_path / "run")
    with RunsClient(endpoints["learner"], timeout=30) as runs:
        run = runs.wait(runs.submit(dump_spec(spec)), timeout=240)
    assert run.state == "SUCCEEDED", run
