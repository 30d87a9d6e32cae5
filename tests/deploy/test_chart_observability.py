"""The chart's Grafana dashboard and the learner's /metrics port, rendered by a real helm.

The dashboard ConfigMap carries the Grafana sidecar's label and a dashboard that parses,
and every series it queries is one marl's services export
(`marl.runtime.prometheus_metrics`), so a renamed metric fails here, not on a blank panel.
"""

from __future__ import annotations

import json
import re

import prometheus_client

from marl.runtime import prometheus_metrics
from tests.support.chart import by_kind, render


def exported_names() -> set[str]:
    names = set()
    for value in vars(prometheus_metrics).values():
        if isinstance(value, prometheus_client.metrics.MetricWrapperBase):
            for family in value.describe():
                names |= {family.name, f"{family.name}_total"} if family.type == "counter" else {
                    family.name}
    return names


def test_dashboard_configmap_renders_with_the_sidecar_label() -> None:
    maps = by_kind(render(), "ConfigMap")
    dashboard = maps["r-marl-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    board = json.loads(dashboard["data"]["marl.json"])
    assert board["uid"] == "marl-training"
    queries = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    used = {m for q in queries for m in re.findall(r"\bmarl_[a-z0-9_]+", q)}
    assert used and used <= exported_names(), used - exported_names()
    for name in ("marl_run_step", "marl_run_reward_mean", "marl_run_val_accuracy",
                 "marl_run_failed_steps", "marl_role_chi2_token", "marl_role_update_chi2",
                 "marl_role_entropy", "marl_role_response_len", "marl_alarms_total"):
        assert name in used, name
    off = by_kind(render(None, "grafana.dashboard.enabled=false"), "ConfigMap")
    assert "r-marl-dashboard" not in off


def test_learner_serves_metrics_where_prometheus_finds_it() -> None:
    docs = render(None, "prometheus.podMonitor.enabled=true")
    learner = by_kind(docs, "StatefulSet")["r-marl-learner"]["spec"]["template"]
    (container,) = learner["spec"]["containers"]
    assert {"name": "http", "containerPort": 8080} in container["ports"]
    assert learner["metadata"]["annotations"]["prometheus.io/port"] == "8080"
    assert "r-marl-learner" in by_kind(docs, "PodMonitor")
    policy = by_kind(docs, "NetworkPolicy")["r-marl-learner"]
    assert any(p["port"] == 8080 for rule in policy["spec"]["ingress"]
               for p in rule.get("ports", []) if rule.get("from"))
