"""The Helm chart renders, lints and validates for every scenario, and refuses bad values."""

from __future__ import annotations

import base64
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from marl.spec.services import MODELS
from tests.support.chart import (
    ALL_VALUES,
    CHART,
    ROOT,
    SCENARIOS,
    by_kind,
    helm,
    render,
    scenario_id,
    workloads,
)

KUBERNETES_VERSION = "1.37.0"
CRD_KINDS = {
    ("keda.sh/v1alpha1", "ScaledObject"),
    ("keda.sh/v1alpha1", "TriggerAuthentication"),
    ("cert-manager.io/v1", "Certificate"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
}


def test_the_scenarios_cover_cpu_gpu_external_redis_keda_tls_and_autoscaling() -> None:
    assert {p.name for p in SCENARIOS} >= {
        "cpu-values.yaml",
        "gpu-values.yaml",
        "external-redis-values.yaml",
        "keda-values.yaml",
        "tls-values.yaml",
        "autoscaling-values.yaml",
    }


@pytest.mark.parametrize("values", ALL_VALUES, ids=scenario_id)
def test_lint_strict(values: Path | None) -> None:
    args = ["lint", "--strict", str(CHART)] + ([] if values is None else ["-f", str(values)])
    out = helm(*args)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 chart(s) failed" in out.stdout


@pytest.mark.parametrize("values", ALL_VALUES, ids=scenario_id)
def test_every_manifest_validates_against_kubernetes(values: Path | None) -> None:
    docs = render(values)
    checked = 0
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
            continue  # CRDs (KEDA, cert-manager, prometheus-operator): checked by their tests
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        checked += 1
    assert checked >= 10


def test_keda_scales_workers_on_the_tasks_stream_instead_of_the_hpa() -> None:
    docs = render(CHART / "ci" / "keda-values.yaml")
    (scaled,) = by_kind(docs, "ScaledObject").values()
    assert "r-marl-workflow" in by_kind(docs, "Deployment")
    assert scaled["spec"]["scaleTargetRef"]["name"] == "r-marl-workflow"
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "redis-streams"
    assert trigger["metadata"]["stream"] == "marl:tasks"
    assert trigger["metadata"]["consumerGroup"] == "workers"
    assert trigger["metadata"]["lagCount"] == "32"
    assert trigger["authenticationRef"]["name"] in by_kind(docs, "TriggerAuthentication")
    assert "r-marl-workflow" not in by_kind(docs, "HorizontalPodAutoscaler")
    assert "replicas" not in by_kind(docs, "Deployment")["r-marl-workflow"]["spec"]


def _env(doc: dict[str, Any]) -> dict[str, Any]:
    (container,) = doc["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_redis_url_in_release_external_and_with_a_token() -> None:
    plain = workloads(render(None, "auth.enabled=false"))
    assert _env(plain["r-marl-learner"])["MARL_LEARNER_REDIS"] == "redis://r-marl-redis:6379/0"
    authed = render(None, "auth.token=t0k")
    secret = by_kind(authed, "Secret")["r-marl-auth"]
    assert secret["data"]["token"] == "dDBr"  # base64("t0k")
    env = _env(workloads(authed)["r-marl-workflow"])
    assert env["MARL_WORKFLOW_REDIS"] == "redis://:$(MARL_AUTH_TOKEN)@r-marl-redis:6379/0"
    assert env["MARL_AUTH_TOKEN"]["secretKeyRef"] == {"name": "r-marl-auth", "key": "token"}
    redis_args = workloads(authed)["r-marl-redis"]["spec"]["template"]["spec"]["containers"][0]
    assert "--appendonly" in redis_args["args"]
    external = render(CHART / "ci" / "external-redis-values.yaml")
    assert "r-marl-redis" not in workloads(external)
    # existingSecret: the chart makes no services' Secret, only the sandbox's own token
    assert set(by_kind(external, "Secret")) == {"r-marl-sandbox-auth"}
    env = _env(workloads(external)["r-marl-inference"])
    assert env["MARL_INFERENCE_REDIS"].endswith("@redis.data.svc.cluster.local:6379/2")
    assert env["MARL_AUTH_TOKEN"]["secretKeyRef"]["name"] == "marl-redis-password"


def test_redis_password_is_never_on_a_command_line_and_memory_is_bounded() -> None:
    """Redis reads the token from the mounted Secret and keeps only its SHA-256 (an ACL
    file): no argument and no environment variable of its container holds the token or a
    reference to it. maxmemory (a value) with noeviction: past it writes are refused."""
    token = "t0k-never-in-args"
    for docs in (render(None, f"auth.token={token}"), render(CHART / "ci" / "tls-values.yaml")):
        redis = workloads(docs)["r-marl-redis"]["spec"]["template"]["spec"]
        (c,) = redis["containers"]
        words = [*c["command"], *c["args"]]
        assert not any(token in w or "MARL_AUTH_TOKEN" in w or "requirepass" in w
                       for w in words), words
        assert "env" not in c
        assert "--aclfile" in c["command"][2] and "sha256sum" in c["command"][2]
        assert "/etc/marl-redis-auth/token" in c["command"][2]
        mount = next(m for m in c["volumeMounts"] if m["name"] == "auth")
        assert mount["mountPath"] == "/etc/marl-redis-auth" and mount["readOnly"]
        auth = next(v for v in redis["volumes"] if v["name"] == "auth")
        assert auth["secret"]["defaultMode"] == 0o400
        args = c["args"]
        assert args[args.index("--maxmemory") + 1] == "3gb"
        assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    plain = workloads(render(None, "auth.enabled=false", "redis.maxmemory=512mb"))
    (c,) = plain["r-marl-redis"]["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["redis-server"]
    assert c["args"][c["args"].index("--maxmemory") + 1] == "512mb"


def test_inference_gets_gpus_probes_and_a_headless_service() -> None:
    docs = render()
    inf = workloads(docs)["r-marl-inference"]["spec"]["template"]["spec"]["containers"][0]
    assert inf["resources"]["limits"]["nvidia.com/gpu"] == 1
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert inf[probe]["grpc"]["port"] == 50052
    assert _env(workloads(docs)["r-marl-inference"])["MARL_INFERENCE_HOST"] == {
        "fieldRef": {"fieldPath": "status.podIP"}
    }
    assert by_kind(docs, "Service")["r-marl-inference"]["spec"]["clusterIP"] == "None"
    cpu = workloads(render(CHART / "ci" / "cpu-values.yaml"))["r-marl-inference"]
    assert "nvidia.com/gpu" not in str(cpu)


def test_learner_statefulset_keeps_checkpoints_and_has_a_pdb() -> None:
    docs = render()
    learner = by_kind(docs, "StatefulSet")["r-marl-learner"]
    (claim,) = learner["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data"
    mounts = learner["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "data", "mountPath": "/data"} in mounts
    config = yaml.safe_load(by_kind(docs, "ConfigMap")["r-marl-learner"]["data"]["learner.yaml"])
    assert config["runs_dir"].startswith("/data/")
    pdb = by_kind(docs, "PodDisruptionBudget")["r-marl-learner"]
    assert pdb["spec"]["selector"]["matchLabels"] == learner["spec"]["selector"]["matchLabels"]
    assert "r-marl-learner" in by_kind(docs, "Service")


def test_every_pod_that_loads_the_model_mounts_the_models_claim() -> None:
    docs = workloads(render(CHART / "ci" / "gpu-values.yaml"))
    for name in ("r-marl-inference", "r-marl-workflow", "r-marl-learner"):
        pod = docs[name]["spec"]["template"]["spec"]
        claims = [
            v["persistentVolumeClaim"]["claimName"]
            for v in pod["volumes"]
            if "persistentVolumeClaim" in v
        ]
        assert claims == ["qwen3-models"], name
        mounts = pod["containers"][0]["volumeMounts"]
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in mounts, name


def test_selectors_never_carry_the_chart_version() -> None:
    for doc in workloads(render()).values():
        labels = doc["spec"]["selector"]["matchLabels"]
        assert "helm.sh/chart" not in labels and "app.kubernetes.io/version" not in labels


@pytest.mark.parametrize("values", ALL_VALUES, ids=scenario_id)
def test_config_blocks_are_the_service_models(values: Path | None) -> None:
    """Each ConfigMap is what `marl serve X --config` reads: it must load without error."""
    docs = by_kind(render(values), "ConfigMap")
    for service, model in MODELS.items():
        name = f"r-marl-{service}"
        if name not in docs:
            continue
        data = yaml.safe_load(docs[name]["data"][f"{service}.yaml"])
        model(**data)
    if "r-marl-sandbox" in docs:
        wf = yaml.safe_load(docs["r-marl-workflow"]["data"]["workflow.yaml"])
        assert wf["sandbox"] == "r-marl-sandbox:50054"


def test_schema_is_generated_from_the_models() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_chart_schema.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("workflow.replicas=many", "workflow.replicas: Invalid type. Expected: integer"),
        ("sandbox.config.max_concurrency=lots", "sandbox.config.max_concurrency: Invalid type"),
        (
            "learner.persistence.sise=1Gi",
            "learner.persistence: Additional property sise is not allowed",
        ),
        ("inference.config.temperature=0.5", "Additional property temperature is not allowed"),
        ("sandbox.config.isolation=chroot", "sandbox.config.isolation must be one of"),
        ("learner.worldSize=2", "Additional property worldSize is not allowed"),
        ("learner.nodes=0", "learner.nodes: Must be greater than or equal to 1"),
    ],
)
def test_schema_refuses_bad_values_naming_them(setting: str, message: str) -> None:
    out = helm("template", "r", str(CHART), "--set", setting)
    assert out.returncode != 0
    assert message in out.stderr, out.stderr


def test_default_install_has_auth_on_with_a_generated_token_every_service_reads() -> None:
    """Auth is on by default (marl.runtime.auth): a Secret with a generated token that
    every marl service and Redis read; turned off, none gets a token."""
    services = ("inference", "workflow", "learner", "sandbox")
    docs = render()
    secret = by_kind(docs, "Secret")["r-marl-auth"]
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) == 48 and token.isalnum()
    again = base64.b64decode(by_kind(render(), "Secret")["r-marl-auth"]["data"]["token"])
    assert again.decode() != token  # generated per install, not a constant of the chart
    for s in services:
        if s == "sandbox":  # it holds a token of its own only (test_chart_security)
            assert "MARL_AUTH_TOKEN" not in _env(workloads(docs)["r-marl-sandbox"])
            continue
        ref = _env(workloads(docs)[f"r-marl-{s}"])["MARL_AUTH_TOKEN"]["secretKeyRef"]
        assert ref == {"name": "r-marl-auth", "key": "token"}, s
    redis = workloads(docs)["r-marl-redis"]["spec"]["template"]
    assert any(v.get("secret", {}).get("secretName") == "r-marl-auth"
               for v in redis["spec"]["volumes"])
    assert _env(workloads(docs)["r-marl-learner"])["MARL_LEARNER_REDIS"].startswith(
        "redis://:$(MARL_AUTH_TOKEN)@")
    # an upgrade keeps the installed token: the template reads its own Secret back
    source = (CHART / "templates" / "secret.yaml").read_text()
    assert 'lookup "v1" "Secret" .Release.Namespace $name' in source
    plain = workloads(render(None, "auth.enabled=false"))
    assert not by_kind(render(None, "auth.enabled=false"), "Secret")
    for s in services:
        assert "MARL_AUTH_TOKEN" not in _env(plain[f"r-marl-{s}"]), s
    authed = workloads(render(None, "auth.existingSecret=marl-token"))
    for s in services[:3]:
        ref = _env(authed[f"r-marl-{s}"])["MARL_AUTH_TOKEN"]["secretKeyRef"]
        assert ref == {"name": "marl-token", "key": "token"}, s


def test_users_token_file_reaches_the_learner_and_inference_only() -> None:
    docs = workloads(render(None, "auth.users.existingSecret=marl-users"))
    for s in ("learner", "inference"):
        pod = docs[f"r-marl-{s}"]["spec"]["template"]["spec"]
        assert _env(docs[f"r-marl-{s}"])["MARL_AUTH_TOKENS_FILE"] == "/etc/marl-users/tokens.csv"
        (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "users"]
        assert mount == {"name": "users", "mountPath": "/etc/marl-users", "readOnly": True}
        assert "subPath" not in mount  # a subPath mount never sees the Secret's updates
        (volume,) = [v for v in pod["volumes"] if v["name"] == "users"]
        assert volume["secret"]["secretName"] == "marl-users"
    for s in ("workflow", "sandbox"):
        assert "MARL_AUTH_TOKENS_FILE" not in _env(docs[f"r-marl-{s}"]), s
    plain = workloads(render())
    assert "MARL_AUTH_TOKENS_FILE" not in _env(plain["r-marl-learner"])


def test_a_trace_dir_in_the_values_reaches_the_service_config() -> None:
    docs = by_kind(render(None, "learner.config.trace_dir=/tmp/marl-trace"), "ConfigMap")
    learner = yaml.safe_load(docs["r-marl-learner"]["data"]["learner.yaml"])
    assert MODELS["learner"](**learner).trace_dir == "/tmp/marl-trace"
    workflow = yaml.safe_load(docs["r-marl-workflow"]["data"]["workflow.yaml"])
    assert workflow.get("trace_dir") is None


def test_learner_grace_covers_its_drain_on_sigterm() -> None:
    """The learner checkpoints the step it is on within config.drain_s of SIGTERM and exits
    within ~10 s more: the pod's grace is drain_s + 20."""
    learner = workloads(render())["r-marl-learner"]["spec"]["template"]["spec"]
    assert learner["terminationGracePeriodSeconds"] == 120
    longer = workloads(render(None, "learner.config.drain_s=300"))["r-marl-learner"]
    assert longer["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 320
