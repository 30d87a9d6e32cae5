"""Several learner pods (issue 70): `learner.replicas` of them take runs from the one queue
in Redis, each training up to `config.max_concurrent_runs` at once; with
`persistence.existingClaim` they share one volume instead of one each."""

from __future__ import annotations

import yaml
from chart_support import CHART, by_kind, render

from marl.spec.services import LearnerConfig


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
    from chart_support import helm

    out = helm("template", "r", str(CHART), "--set", "learner.replicas=0")
    assert out.returncode != 0 and "learner.replicas" in out.stderr, out.stderr
