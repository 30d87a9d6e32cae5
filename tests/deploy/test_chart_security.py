"""Security properties of the rendered chart, for every scenario, plus checkov.

`violations()` is the policy: the restricted Pod Security Standard for every
pod, no service-account token anywhere (no marl pod calls the API), a read-only
root, for the sandbox — which runs untrusted code — a NetworkPolicy with no
egress that admits only workflow pods, and for the learner's Runs API no ingress
rule open to all (only marl pods, labelled clients and listed namespaces). Each
sabotage test renders the chart with one protection removed and checks that the
policy notices.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support.chart import (
    ALL_VALUES,
    CHART,
    ROOT,
    by_kind,
    render,
    render_text,
    scenario_id,
    workloads,
)

CHECKOV = ROOT / ".cache" / "tools" / "checkov" / "bin" / "checkov"


def _seccomp(ctx: dict[str, Any] | None) -> str | None:
    return ((ctx or {}).get("seccompProfile") or {}).get("type")


def pod_violations(name: str, pod: dict[str, Any]) -> list[str]:
    out = []
    psc = pod.get("securityContext") or {}
    if pod.get("automountServiceAccountToken") is not False:
        out.append(f"{name}: service-account token mounted")
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            out.append(f"{name}: {key}")
    for c in pod.get("initContainers", []) + pod["containers"]:
        csc = c.get("securityContext") or {}
        where = f"{name}/{c['name']}"
        if not (csc.get("runAsNonRoot") or psc.get("runAsNonRoot")):
            out.append(f"{where}: may run as root")
        if (csc.get("runAsUser", psc.get("runAsUser")) or 0) == 0:
            out.append(f"{where}: uid 0")
        if csc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{where}: privilege escalation allowed")
        if csc.get("privileged"):
            out.append(f"{where}: privileged")
        if (csc.get("capabilities") or {}).get("drop") != ["ALL"]:
            out.append(f"{where}: capabilities not all dropped")
        if (csc.get("capabilities") or {}).get("add"):
            out.append(f"{where}: capabilities added")
        if (_seccomp(csc) or _seccomp(psc)) != "RuntimeDefault":
            out.append(f"{where}: seccomp is not RuntimeDefault")
        if csc.get("readOnlyRootFilesystem") is not True:
            out.append(f"{where}: writable root filesystem")
    return out


def sandbox_network_violations(docs: list[dict[str, Any]]) -> list[str]:
    if "r-marl-sandbox" not in workloads(docs):
        return []
    sandbox = workloads(docs)["r-marl-sandbox"]
    labels = sandbox["spec"]["template"]["metadata"]["labels"]
    workflow_selector = workloads(docs)["r-marl-workflow"]["spec"]["selector"]["matchLabels"]
    policies = [
        p
        for p in by_kind(docs, "NetworkPolicy").values()
        if all(
            labels.get(k) == v for k, v in p["spec"]["podSelector"].get("matchLabels", {}).items()
        )
    ]
    if not policies:
        return ["sandbox: no NetworkPolicy selects it"]
    out = []
    if not any(
        "Egress" in p["spec"].get("policyTypes", []) and not p["spec"].get("egress")
        for p in policies
    ):
        out.append("sandbox: egress is not denied")
    for p in policies:
        for rule in p["spec"].get("egress") or []:
            out.append(f"sandbox: egress allowed by {p['metadata']['name']}: {rule}")
        for rule in p["spec"].get("ingress") or []:
            peers = rule.get("from") or [{}]
            for peer in peers:
                if peer.get("podSelector", {}).get("matchLabels") != workflow_selector:
                    out.append(f"sandbox: ingress from {peer or 'anywhere'}")
    return out


def _selects_all(selector: dict[str, Any] | None) -> bool:
    return selector is not None and not selector.get("matchLabels") and not selector.get(
        "matchExpressions")


def open_peer(peer: dict[str, Any]) -> bool:
    """Whether a NetworkPolicy peer admits every pod (of a namespace or of the cluster) or
    an address block."""
    pods = peer.get("podSelector")
    namespaces = peer.get("namespaceSelector")
    if "ipBlock" in peer or (pods is None and namespaces is None):
        return True
    if namespaces is None:
        return _selects_all(pods)
    return _selects_all(namespaces) and (pods is None or _selects_all(pods))


def learner_network_violations(docs: list[dict[str, Any]]) -> list[str]:
    """The learner's Runs API: no rule admits anyone (no `from`, or a peer for all)."""
    policies = by_kind(docs, "NetworkPolicy")
    if "r-marl-learner" not in workloads(docs) or not policies:
        return []
    if "r-marl-learner" not in policies:
        return ["learner: no NetworkPolicy selects it"]
    out = []
    for rule in policies["r-marl-learner"]["spec"].get("ingress") or []:
        peers = rule.get("from")
        if not peers:
            out.append(f"learner: ingress from anywhere: {rule}")
        out += [f"learner: ingress from every pod: {peer}" for peer in peers or []
                if open_peer(peer)]
    return out


def violations(docs: list[dict[str, Any]]) -> list[str]:
    out = []
    for name, doc in workloads(docs).items():
        out += pod_violations(name, doc["spec"]["template"]["spec"])
    return out + sandbox_network_violations(docs) + learner_network_violations(docs)


@pytest.mark.parametrize("values", ALL_VALUES, ids=scenario_id)
def test_every_pod_is_restricted_and_the_sandbox_is_walled_off(values: Path | None) -> None:
    docs = render(values)
    assert workloads(docs), "nothing rendered"
    assert violations(docs) == []


def test_learner_admits_marl_pods_labelled_clients_and_listed_namespaces_only() -> None:
    docs = render(None, "networkPolicy.clients.namespaces={team-a}",
                  "inference.config.http_port=8000")
    policies = by_kind(docs, "NetworkPolicy")
    rule, scrape = policies["r-marl-learner"]["spec"]["ingress"]
    assert rule["ports"] == [{"port": 50051, "protocol": "TCP"}]
    # the only other rule: Prometheus's namespace to /metrics (the training gauges)
    assert scrape["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
    assert rule["from"] == [
        {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "marl",
                                         "app.kubernetes.io/instance": "r"}}},
        {"podSelector": {"matchLabels": {"marl.dev/client": "true"}}},
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "team-a"}}},
    ]
    # inference's OpenAI port: the same callers, and Prometheus for /metrics
    http = [r for r in policies["r-marl-inference"]["spec"]["ingress"]
            if r["ports"] == [{"port": 8000, "protocol": "TCP"}]]
    (http_rule,) = http
    assert http_rule["from"][:3] == rule["from"]
    assert not [p for p in http_rule["from"] if open_peer(p)]
    # no labels configured: no labelled clients, never an empty (all-pods) selector
    bare, _ = by_kind(render(None, "networkPolicy.clients.podLabels=null"),
                      "NetworkPolicy")["r-marl-learner"]["spec"]["ingress"]
    assert len(bare["from"]) == 1 and not open_peer(bare["from"][0])


@pytest.mark.parametrize("sabotage", ["no-from", "empty-selector", "ip-block"])
def test_sabotage_an_open_learner_rule_is_noticed(sabotage: str) -> None:
    docs = render()
    rule = by_kind(docs, "NetworkPolicy")["r-marl-learner"]["spec"]["ingress"][0]
    if sabotage == "no-from":
        del rule["from"]
    elif sabotage == "empty-selector":
        rule["from"].append({"podSelector": {}})
    else:
        rule["from"].append({"ipBlock": {"cidr": "0.0.0.0/0"}})
    assert [v for v in violations(docs) if v.startswith("learner: ingress from")]


def test_sandbox_pod_has_no_token_no_links_and_scratch_only_in_tmp() -> None:
    pod = workloads(render())["r-marl-sandbox"]["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["enableServiceLinks"] is False
    (container,) = pod["containers"]
    assert [m["mountPath"] for m in container["volumeMounts"]] == [
        "/etc/marl", "/tmp", "/etc/marl-sandbox-auth"]
    tmp = next(v for v in pod["volumes"] if v["name"] == "tmp")
    assert tmp["emptyDir"]["sizeLimit"]


def _secrets_of(pod: dict[str, Any]) -> set[str]:
    """Every Secret a pod's containers read: env references and mounted volumes."""
    names = {v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v}
    for c in [*pod["containers"], *pod.get("initContainers", [])]:
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                names.add(ref["name"])
        for f in c.get("envFrom", []):
            if "secretRef" in f:
                names.add(f["secretRef"]["name"])
    return names


@pytest.mark.parametrize("sets", [
    (), ("tls.enabled=true", "tls.certManager.enabled=true", "tls.certManager.issuerRef.name=i"),
    ("auth.existingSecret=ops-token", "auth.users.existingSecret=ops-users"),
    ("auth.sandbox.existingSecret=ops-sandbox",),
])
def test_sandbox_holds_its_own_token_never_the_services(sets: tuple[str, ...]) -> None:
    """The sandbox pod reads one Secret of marl's: the sandbox's own token (a file, not an
    env var), which the workflow pods hold too and no other pod; the services' token and
    the users' file never reach it."""
    docs = render(None, *sets)
    pods = {name: w["spec"]["template"]["spec"] for name, w in workloads(docs).items()}
    own = next((s.split("=", 1)[1] for s in sets if s.startswith("auth.sandbox.")),
               "r-marl-sandbox-auth")
    services = next((s.split("=", 1)[1] for s in sets if s.startswith("auth.existingSecret")),
                    "r-marl-auth")
    sandbox = pods["r-marl-sandbox"]
    assert own in _secrets_of(sandbox)
    assert not _secrets_of(sandbox) & {services, "ops-users"}
    (container,) = sandbox["containers"]
    env = {e["name"]: e for e in container.get("env", [])}
    assert env["MARL_SANDBOX_TOKEN_FILE"] == {"name": "MARL_SANDBOX_TOKEN_FILE",
                                              "value": "/etc/marl-sandbox-auth/token"}
    assert not any(k.startswith("MARL_AUTH") or "valueFrom" in e for k, e in env.items())
    workflow = pods["r-marl-workflow"]
    assert {own, services} <= _secrets_of(workflow)
    (worker,) = workflow["containers"]
    assert any(e["name"] == "MARL_SANDBOX_TOKEN_FILE" for e in worker["env"])
    assert "/etc/marl-sandbox-auth" in {m["mountPath"] for m in worker["volumeMounts"]}
    for name, spec in pods.items():
        if name not in ("r-marl-sandbox", "r-marl-workflow"):
            assert own not in _secrets_of(spec), name
    made = by_kind(docs, "Secret")
    if own == "r-marl-sandbox-auth":  # generated at install, kept on upgrade with lookup
        token = made[own]["data"]["token"]
        assert len(token) == 64 and token != made.get("r-marl-auth", {}).get("data", {}).get(
            "token")
    else:
        assert own not in made
    source = (CHART / "templates" / "secret.yaml").read_text()
    assert source.count('lookup "v1" "Secret" .Release.Namespace $name') == 2
    assert not by_kind(render(None, *sets, "auth.enabled=false"), "Secret")


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ("sandbox.seccompProfile.type=Localhost", "sandbox/sandbox: seccomp is not RuntimeDefault"),
        ("sandbox.seccompProfile.localhostProfile=x", None),
    ],
)
def test_sabotage_seccomp_is_noticed(setting: str, expected: str | None) -> None:
    found = violations(render(None, setting))
    if expected is None:
        assert found == []
    else:
        assert any(expected.replace("sandbox/", "r-marl-sandbox/") in v for v in found), found


def test_sabotage_pod_level_changes_are_noticed() -> None:
    docs = render()
    pod = workloads(docs)["r-marl-sandbox"]["spec"]["template"]["spec"]
    pod["automountServiceAccountToken"] = True
    pod["containers"][0]["securityContext"]["allowPrivilegeEscalation"] = True
    pod["containers"][0]["securityContext"]["capabilities"] = {"drop": ["NET_RAW"]}
    by_kind(docs, "NetworkPolicy")["r-marl-sandbox"]["spec"]["egress"] = [{"to": []}]
    found = " ".join(violations(docs))
    for problem in (
        "token mounted",
        "privilege escalation",
        "capabilities not all dropped",
        "egress allowed",
    ):
        assert problem in found


def test_checkov_finds_nothing_unexplained(tmp_path: Path) -> None:
    if not CHECKOV.exists():
        pytest.skip(
            "no checkov: run `python scripts/get_deploy_tools.py checkov` (make test-deploy)"
        )
    for values in ALL_VALUES:
        (tmp_path / f"{scenario_id(values)}.yaml").write_text(render_text(values))
    out = subprocess.run(
        [
            str(CHECKOV),
            "-d",
            str(tmp_path),
            "--framework",
            "kubernetes",
            "--skip-download",
            "--compact",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert re.search(r"Failed checks: 0\b", out.stdout), out.stdout[-4000:]
    assert re.search(r"Passed checks: [1-9]", out.stdout), out.stdout[-2000:]
    # every skip the chart takes carries its reason next to it
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    skips = re.findall(r"checkov\.io/skip\d+: (CKV_\w+)=(.+)", helpers)
    assert skips and all(len(reason) > 20 for _, reason in skips)
    for check, _ in skips:
        assert re.search(rf"- {check} \(", helpers), f"{check} has no explanation comment"


def test_workers_reach_only_what_an_episode_needs() -> None:
    """The workers run a run's code and call its judge: their egress is DNS, Redis,
    inference and the sandbox, plus the operator's `workflow.egress` (judge endpoints); a
    spec cannot make them send anything elsewhere."""
    policies = by_kind(render(), "NetworkPolicy")
    egress = policies["r-marl-workflow-egress"]["spec"]
    assert egress["policyTypes"] == ["Egress"]
    assert egress["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "workflow"
    reached = set()
    for rule in egress["egress"]:
        assert rule.get("to"), rule  # never a rule open to every address
        for peer in rule["to"]:
            labels = peer.get("podSelector", {}).get("matchLabels", {})
            reached.add(labels.get("app.kubernetes.io/component") or labels.get("k8s-app"))
    assert reached == {"kube-dns", "redis", "inference", "sandbox"}
    judge = {"to": [{"ipBlock": {"cidr": "10.0.5.0/24"}}], "ports": [{"port": 443}]}
    listed = by_kind(render(None, "workflow.egress[0].to[0].ipBlock.cidr=10.0.5.0/24",
                            "workflow.egress[0].ports[0].port=443"), "NetworkPolicy")
    assert judge in listed["r-marl-workflow-egress"]["spec"]["egress"]
    off = by_kind(render(None, "networkPolicy.enabled=false"), "NetworkPolicy")
    assert "r-marl-workflow-egress" not in off


def test_the_learner_takes_models_from_the_models_volume_only() -> None:
    import yaml

    from marl.spec.services import LearnerConfig

    learner = yaml.safe_load(
        by_kind(render(), "ConfigMap")["r-marl-learner"]["data"]["learner.yaml"])
    cfg = LearnerConfig(**learner)
    assert cfg.model_roots == ["/models"] and cfg.data_roots == [] and cfg.allowed_modules == []
    assert cfg.out_dir_roots == [] and cfg.judge_endpoints == []
