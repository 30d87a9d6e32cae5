"""Several learner pods (issue 70): `learner.replicas` of them take runs from the one queue
in Redis, each training up to `config.max_concurrent_runs` at once; with
`persistence.existingClaim` they share one volume instead of one each."""

from __future__ import annotations

import yaml

from marl.spec.services import LearnerConfig
from tests.support.chart import CHART, by_kind, render


def test_learner_replicas_share_the_runs_volume_and_train_runs_at_once() -> None:
    docs = render(CHART / "ci" / "learners-values.yaml")
    learner = by_kind(docs, "StatefulSet")["r-marl-learner"]
    assert learner["spec"]["replicas"] == 3
    assert "volumeClaimTemplates" not in learner["spec"]
    pod = learner["spec"]["template"]["spec"]
    assert {"name": "data", "persistentVolumeClaim": {"claimName": "marl-runs"}} in pod["volumes"]
    assert {"name": "data", "mountPath": "/data"} in pod["containers"][0]["volumeMounts"]
    config = yaml.safe_load(by_kind(docs, "ConfigMap")["r-marl-learner"]["data"]["learner.yaml"])
    assert LearnerConfig(**config).max_concurrent_runs == 2


def test_one_learner_with_a_volume_of_its_own_by_default() -> None:
    learner = by_kind(render(), "StatefulSet")["r-marl-learner"]
    assert learner["spec"]["replicas"] == 1
    (claim,) = learner["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data"


def test_learner_replicas_below_one_are_refused() -> None:
    from tests.support.chart import helm

    out = helm("template", "r", str(CHART), "--set", "learner.replicas=0")
    assert out.returncode != 0 and "learner.replicas" in out.stderr, out.stderr


def test_learner_nodes_render_one_launched_group_across_pods() -> None:
    """`learner.nodes=2, learner.gpu=4`: two pods of four GPUs, each running torch's
    launcher with four ranks, world size 8, meeting at pod 0 through the headless Service."""
    docs = render(CHART / "ci" / "learner-nodes-values.yaml")
    learner = by_kind(docs, "StatefulSet")["r-marl-learner"]
    spec = learner["spec"]
    assert spec["replicas"] == 2 and spec["podManagementPolicy"] == "Parallel"
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert spec["template"]["metadata"]["annotations"]["marl.dev/world-size"] == "8"
    command = container["command"]
    assert command[:3] == ["python", "-m", "torch.distributed.run"]
    assert "--nnodes=2" in command and "--nproc-per-node=4" in command
    assert "--rdzv-backend=c10d" in command
    assert "--rdzv-endpoint=r-marl-learner-0.r-marl-learner-headless.marl.svc:29400" in command
    assert command[-4:] == ["-m", "marl.cli", "serve", "learner"]
    assert container["args"] == ["--config", "/etc/marl/learner.yaml"]
    assert spec["serviceName"] == "r-marl-learner-headless"
    headless = by_kind(docs, "Service")["r-marl-learner-headless"]["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    assert "livenessProbe" not in container  # only rank 0's pod serves; torchrun watches ranks
    assert {"name": "rendezvous", "containerPort": 29400} in container["ports"]
    pdb = by_kind(docs, "PodDisruptionBudget")["r-marl-learner"]["spec"]
    assert pdb["maxUnavailable"] == 0 and "minAvailable" not in pdb
    policy = by_kind(docs, "NetworkPolicy")["r-marl-learner"]["spec"]
    peers = [rule["from"][0].get("podSelector", {}).get("matchLabels") for rule in policy["ingress"]]
    assert spec["selector"]["matchLabels"] in peers


def test_a_multi_pod_learner_without_a_shared_volume_is_refused() -> None:
    from tests.support.chart import helm

    out = helm("template", "r", str(CHART), "--set", "learner.nodes=2")
    assert out.returncode != 0 and "learner.persistence.existingClaim" in out.stderr, out.stderr


def test_learner_replicas_of_several_nodes_render_one_group_each() -> None:
    """`learner.replicas=2, nodes=2, gpu=4`: two independent learners, each a StatefulSet of
    two 4-GPU pods with a selector, a headless Service and a rendezvous of its own; the Runs
    API Service reaches either's rank 0, and both share the runs volume."""
    docs = render(CHART / "ci" / "learner-groups-values.yaml")
    sets = by_kind(docs, "StatefulSet")
    services = by_kind(docs, "Service")
    learners = {n: s for n, s in sets.items() if "learner" in n}
    assert sorted(learners) == ["r-marl-learner-g0", "r-marl-learner-g1"]
    selectors = []
    for g, name in enumerate(sorted(learners)):
        spec = learners[name]["spec"]
        assert spec["replicas"] == 2 and spec["podManagementPolicy"] == "Parallel"
        pod = spec["template"]
        assert pod["metadata"]["labels"]["marl.dev/learner-group"] == str(g)
        assert pod["metadata"]["annotations"]["marl.dev/world-size"] == "8"
        (container,) = pod["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
        command = container["command"]
        assert "--nnodes=2" in command and "--nproc-per-node=4" in command
        assert f"--rdzv-endpoint={name}-0.{name}-headless.marl.svc:29400" in command
        assert f"--rdzv-id={name}" in command
        assert spec["serviceName"] == f"{name}-headless"
        headless = services[f"{name}-headless"]["spec"]
        assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
        assert headless["selector"] == spec["selector"]["matchLabels"]
        assert spec["selector"]["matchLabels"]["marl.dev/learner-group"] == str(g)
        assert {"name": "data", "persistentVolumeClaim": {"claimName": "marl-runs"}} in pod[
            "spec"]["volumes"]
        selectors.append(spec["selector"]["matchLabels"])
    assert selectors[0] != selectors[1]  # no pod of one group is the other's
    assert "r-marl-learner-headless" not in services
    runs_api = services["r-marl-learner"]["spec"]["selector"]
    assert all(runs_api.items() <= s.items() for s in selectors)
    pdb = by_kind(docs, "PodDisruptionBudget")["r-marl-learner"]["spec"]
    assert pdb["maxUnavailable"] == 0 and pdb["selector"]["matchLabels"] == runs_api
    policy = by_kind(docs, "NetworkPolicy")["r-marl-learner"]["spec"]
    peers = [rule["from"][0].get("podSelector", {}).get("matchLabels") for rule in policy["ingress"]]
    assert runs_api in peers  # a group's pods reach one another
