"""Every running service answers Prometheus `/metrics` on its HTTP port, with its own numbers.

The whole local cluster (inference, workflow, sandbox, learner as real processes) is
started once; each service gets one real call of its own (a generation, a sandboxed
program, a ListRuns) and its scrape must show that call counted, next to the
service-specific gauges and counters.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import grpc
import requests
from prometheus_client.parser import text_string_to_metric_families

import marl
from marl.clients.runs import RunsClient
from marl.protocol.v1 import inference_pb2, inference_pb2_grpc


def scrape(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    reply = requests.get(f"http://{address}/metrics", timeout=10)
    assert reply.status_code == 200
    assert reply.headers["Content-Type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(reply.text)
        for s in family.samples
    }


def value(samples: dict[Any, float], name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def test_every_service_serves_metrics_with_its_grpc_calls(endpoints: dict[str, Any]) -> None:
    health = "/grpc.health.v1.Health/Check"
    for kind in ("inference", "workflow", "sandbox", "learner"):
        (address,) = endpoints[f"{kind}_http"]
        samples = scrape(address)
        # the launcher waited on each service's health check: counted with its code
        ok = value(samples, "marl_requests_total", protocol="grpc", method=health, code="OK")
        assert ok is not None and ok >= 1, kind
        assert value(samples, "process_resident_memory_bytes") is not None, kind


def test_inference_counts_generate_calls_and_loaded_adapters(endpoints: dict[str, Any]) -> None:
    (address,) = endpoints["inference"]
    (http,) = endpoints["inference_http"]
    stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(address))
    before = scrape(http)
    method = "/marl.v1.Inference/GetInfo"
    n0 = value(before, "marl_requests_total", protocol="grpc", method=method, code="OK") or 0.0
    stub.GetInfo(inference_pb2.GetInfoRequest(), timeout=10)
    after = scrape(http)
    assert value(after, "marl_requests_total", protocol="grpc", method=method, code="OK") == n0 + 1
    assert value(after, "marl_request_seconds_count", protocol="grpc", method=method) == n0 + 1
    assert value(after, "marl_adapter_versions_loaded") == 0.0  # no run has pushed one
    # the OpenAI front end's requests are counted by route
    assert requests.get(f"http://{http}/v1/models", timeout=10).status_code == 200
    models = value(
        scrape(http), "marl_requests_total", protocol="http", method="GET /v1/models", code="200"
    )
    assert models == 1.0


def test_sandbox_counts_verdicts(endpoints: dict[str, Any]) -> None:
    (http,) = endpoints["sandbox_http"]
    body = {"code": "print(int(input()) + 1)", "language": "python", "stdin": "41"}
    reply = requests.post(f"http://{http}/run_code", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    samples = scrape(http)
    verdicts = {
        dict(labels)["verdict"]: v
        for (name, labels), v in samples.items()
        if name == "marl_sandbox_verdicts_total"
    }
    assert sum(verdicts.values()) >= 1, verdicts
    posted = value(
        samples, "marl_requests_total", protocol="http", method="POST /run_code", code="200"
    )
    assert posted == 1.0


def test_workflow_in_flight_and_learner_list_runs(endpoints: dict[str, Any]) -> None:
    (wf_http,) = endpoints["workflow_http"]
    samples = scrape(wf_http)
    assert value(samples, "marl_inflight_episodes") == 0.0
    assert value(samples, "marl_stream_lag", stream="marl:tasks", group="workers") == 0.0
    (learner_http,) = endpoints["learner_http"]
    with RunsClient(endpoints["learner"]) as runs:
        assert runs.list() == []
    samples = scrape(learner_http)
    method = "/marl.v1.Learner/ListRuns"
    assert value(samples, "marl_requests_total", protocol="grpc", method=method, code="OK") == 1.0


def test_learner_exports_each_runs_training_by_run_and_role(endpoints: dict[str, Any]) -> None:
    """After a real run: its step, reward, accuracy, failed steps and every role's χ²,
    entropy and response length, labelled by run (and role), on the learner's /metrics."""
    from marl.local.demo import DEMO_SPEC

    model = Path(marl.__file__).parent / "assets" / "demo-model"
    spec = {**DEMO_SPEC, "engine": "transformers", "model": {"path": str(model)},
            "train": {**DEMO_SPEC["train"], "steps": 2, "problems_per_step": 4,
                      "val_interval": 2, "val_problems": 8}}
    with RunsClient(endpoints["learner"]) as runs:
        run_id = runs.submit(spec)
        assert runs.wait(run_id, timeout=600).state == "SUCCEEDED"
    (learner_http,) = endpoints["learner_http"]
    samples = scrape(learner_http)
    assert value(samples, "marl_run_step", run=run_id) == 2.0
    assert value(samples, "marl_run_reward_mean", run=run_id) is not None
    assert value(samples, "marl_run_val_accuracy", run=run_id) is not None
    assert value(samples, "marl_run_failed_steps", run=run_id) == 0.0
    for role in ("generator", "aggregator"):  # Voting's roles
        for name in ("marl_role_chi2_token", "marl_role_update_chi2", "marl_role_entropy",
                     "marl_role_response_len"):
            got = value(samples, name, run=run_id, role=role)
            assert got is not None and math.isfinite(got), (name, role)
