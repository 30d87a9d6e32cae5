"""With `$MARL_AUTH_TOKEN` set, every service refuses a caller without it and marl's own
clients (the learner's pushes, the workers' calls, the CLI's RunsClient) still train.

The whole local cluster runs as real processes with the token in their environment.
Every RPC of every public service is called with no token and with a wrong one:
each answers UNAUTHENTICATED, while health and reflection stay open (probes need
no secret). Then a one-step run is submitted through `RunsClient`: it can only
succeed if the learner's adapter pushes and the workers' generation calls carry
the token, because inference refuses them otherwise.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import marl
from marl.cli import main as cli
from marl.clients.runs import RunRefused, RunsClient
from marl.clients.sandbox import SandboxClient
from marl.local.demo import DEMO_SPEC
from marl.problem import Problem
from marl.protocol.v1 import inference_pb2, learner_pb2, sandbox_pb2, workflow_pb2
from marl.rollout import AdapterRef, Task
from marl.runtime import auth, streams
from marl.runtime.task_signing import PAYLOAD_FIELD, TaskSigner, canonical
from marl.spec.run import apply_overrides, dump_spec, parse_spec
from marl.spec.services import auth_token
from tests.support.raw_grpc import call_raw

TOKEN = "s3cret-test-token"
pytestmark = pytest.mark.cluster(env={"MARL_AUTH_TOKEN": TOKEN})
SERVICES = {
    "inference": inference_pb2.DESCRIPTOR.services_by_name["Inference"],
    "workflow": workflow_pb2.DESCRIPTOR.services_by_name["Workflow"],
    "learner": learner_pb2.DESCRIPTOR.services_by_name["Learner"],
    "sandbox": sandbox_pb2.DESCRIPTOR.services_by_name["Sandbox"],
}


def address(endpoints: dict[str, Any], kind: str) -> str:
    found = endpoints[kind]
    return str(found if isinstance(found, str) else found[0])


@pytest.mark.parametrize("kind", list(SERVICES))
def test_deny_every_rpc_without_the_token(endpoints: dict[str, Any], kind: str) -> None:
    service = SERVICES[kind]
    with grpc.insecure_channel(address(endpoints, kind)) as channel:
        # the sandbox accepts only its own token, never the services' (test_sandbox_token.py)
        shared = [[("authorization", f"Bearer {TOKEN}")]] if kind == "sandbox" else []
        for method in service.methods:
            for metadata in ([], [("authorization", "Bearer wrong")],
                             [("authorization", TOKEN)], *shared):
                code = call_raw(channel, service, method, metadata)
                assert code == grpc.StatusCode.UNAUTHENTICATED, (kind, method.name, metadata)
        # probes and reflection need no secret
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        listed = next(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
        names = {s.name for s in listed.list_services_response.service}
        assert service.full_name in names


def test_deny_http_front_ends_without_the_token(endpoints: dict[str, Any]) -> None:
    (inference,) = endpoints["inference_http"]
    (sandbox,) = endpoints["sandbox_http"]
    body = {"code": "print(1)", "language": "python"}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = requests.get(f"http://{inference}/v1/models", headers=headers, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthenticated"
        r = requests.post(f"http://{sandbox}/run_code", json=body, headers=headers, timeout=30)
        assert r.status_code == 401
    good = {"Authorization": f"Bearer {TOKEN}"}
    assert requests.get(f"http://{inference}/v1/models", headers=good, timeout=10).ok
    r = requests.post(f"http://{sandbox}/run_code", json=body, headers=good, timeout=30)
    assert r.status_code == 401  # the services' token is not the sandbox's
    own = Path(endpoints["sandbox_token_file"]).read_text().strip()
    ran = requests.post(f"http://{sandbox}/run_code", json=body, timeout=60,
                        headers={"Authorization": f"Bearer {own}"})
    assert ran.ok and ran.json()["status"] == "Success"
    for kind in ("inference", "sandbox", "workflow", "learner"):
        (address,) = endpoints[f"{kind}_http"]
        assert requests.get(f"http://{address}/metrics", timeout=10).ok, kind


def test_allow_marl_clients_with_the_token_train_one_step(
        endpoints: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert auth_token() == TOKEN
    monkeypatch.setenv("MARL_SANDBOX_TOKEN_FILE", endpoints["sandbox_token_file"])
    with SandboxClient(endpoints["sandbox"][0]) as sandbox:  # what code-reward workers use
        assert sandbox.execute("print(input())", [{"stdin": "7", "expected_stdout": "7"}]
                               ).pass_rate == 1.0
    data = apply_overrides(DEMO_SPEC, [
        "train.steps=1", "train.problems_per_step=2", "grpo.group_size=2",
        "train.val_problems=2", "train.step_timeout_s=120"])
    spec = parse_spec(data)
    spec.model.path = str(Path(marl.__file__).parent / "assets" / "demo-model")
    spec.out_dir = str(tmp_path / "run")
    with RunsClient(endpoints["learner"], timeout=30) as runs:
        run_id = runs.submit(dump_spec(spec))
        run = runs.wait(run_id, timeout=240)
    assert run.state == "SUCCEEDED", run


def refused_tasks(metrics_urls: list[str]) -> float:
    """marl_tasks_refused_total over every reason, summed over the workers."""
    total = 0.0
    for url in metrics_urls:
        for line in requests.get(url, timeout=10).text.splitlines():
            if line.startswith("marl_tasks_refused_total{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_deny_a_task_forged_into_redis_while_signed_ones_run(
        endpoints: dict[str, Any], tmp_path: Path) -> None:
    """A Redis writer without the token queues a well-formed task (unsigned, and signed
    with a guessed token): the worker refuses both (counted on its /metrics, acknowledged,
    no rollout, no dead letter); the learner's signed tasks then train a step."""
    r = redis.Redis.from_url(endpoints["redis"], decode_responses=True)
    metrics = endpoints["metrics"]["workflow"]
    before = refused_tasks(metrics)
    spec = parse_spec(DEMO_SPEC)
    spec.model.path = str(Path(marl.__file__).parent / "assets" / "demo-model")
    task = Task.for_spec(spec, "forged-run", Problem(id="p", prompt="1+1?", answer="2"), 0,
                         "train", 0, {"generator": AdapterRef("forged-run/generator", 1)})
    r.xadd(streams.TASKS, {PAYLOAD_FIELD: canonical(task.to_dict())})
    r.xadd(streams.TASKS, TaskSigner("guessed").fields(streams.TASKS, task.to_dict()))
    deadline = time.monotonic() + 60
    while refused_tasks(metrics) < before + 2:
        assert time.monotonic() < deadline, "the worker did not refuse the forged tasks"
        time.sleep(0.2)
    assert refused_tasks(metrics) == before + 2
    assert r.xlen(streams.TASKS) == 0 or all(
        json.loads(f[PAYLOAD_FIELD])["run_id"] != "forged-run"
        for _, f in r.xrange(streams.TASKS))
    assert not r.exists(streams.rollouts_stream("forged-run"))
    assert not r.exists(streams.dead_letter_stream(streams.TASKS))
    data = apply_overrides(DEMO_SPEC, [
        "train.steps=1", "train.problems_per_step=2", "grpo.group_size=2",
        "train.val_problems=2", "train.step_timeout_s=120"])
    run_spec = parse_spec(data)
    run_spec.model.path = spec.model.path
    run_spec.out_dir = str(tmp_path / "run")
    with RunsClient(endpoints["learner"], timeout=30) as runs:
        run = runs.wait(runs.submit(dump_spec(run_spec)), timeout=240)
    assert run.state == "SUCCEEDED", run
    assert refused_tasks(metrics) == before + 2  # the learner's tasks all ran


def test_client_channel_sends_the_token_only_when_set(
        endpoints: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from marl.protocol.v1 import learner_pb2_grpc

    request = learner_pb2.ListRunsRequest()
    with auth.channel(endpoints["learner"]) as ch:
        learner_pb2_grpc.LearnerStub(ch).ListRuns(request, timeout=10)
    monkeypatch.delenv("MARL_AUTH_TOKEN")
    with auth.channel(endpoints["learner"]) as ch, pytest.raises(grpc.RpcError) as err:
        learner_pb2_grpc.LearnerStub(ch).ListRuns(request, timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with RunsClient(endpoints["learner"]) as runs, pytest.raises(RunRefused, match="token"):
        runs.list()
    assert cli.main(["status", "some-run", "--learner", endpoints["learner"]]) == 2
    assert "MARL_AUTH_TOKEN" in capsys.readouterr().err
