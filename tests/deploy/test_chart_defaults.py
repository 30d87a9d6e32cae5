"""The chart's `<component>.config` says each service default once: a value there either
equals the service's own default (shown so an operator sees the knob) or is a choice the
chart makes for pods, listed here with its reason. A changed service default fails this
test until the chart follows it or lists why it differs."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from marl.spec.services import (
    LEARNER_PORT,
    InferenceConfig,
    LearnerConfig,
    SandboxConfig,
    WorkflowConfig,
)
from tests.support.chart import CHART

CONFIGS: dict[str, type[BaseModel]] = {
    "inference": InferenceConfig,
    "workflow": WorkflowConfig,
    "learner": LearnerConfig,
    "sandbox": SandboxConfig,
}
POD_INTERFACE = "a pod serves its Service on every interface, not loopback"
SERVICE_PORT = "a fixed port each Service and NetworkPolicy names (a process picks a free one)"
CHART_CHOICES: dict[tuple[str, str], str] = {
    **{(c, "host"): POD_INTERFACE for c in CONFIGS},
    **{(c, "port"): SERVICE_PORT for c in CONFIGS},
    ("inference", "model"): "the models volume's Qwen3-0.6B, the paper's smallest base",
    ("inference", "engine"): "the GPU image serves with vLLM",
    ("inference", "dtype"): "GPUs serve bf16",
    ("workflow", "http_port"): "Prometheus scrapes the workers and KEDA reads their lag",
    ("learner", "http_port"): "Prometheus scrapes each run's training gauges",
    ("learner", "runs_dir"): "the run-output volume is mounted at /data",
    ("learner", "model_roots"): "the models volume is mounted at /models",
    ("sandbox", "max_concurrency"): "jobs at once up to a sandbox pod's CPU limit (4); the default reads the node's CPUs",
}


def default_of(config: type[BaseModel], key: str) -> Any:
    return config.model_fields[key].get_default(call_default_factory=True)


def chart_config(component: str) -> dict[str, Any]:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    config: dict[str, Any] = values[component]["config"]
    return config


@pytest.mark.parametrize("component", sorted(CONFIGS))
def test_chart_config_restates_only_the_services_defaults(component: str) -> None:
    config = CONFIGS[component]
    for key, value in chart_config(component).items():
        assert key in config.model_fields, f"{component}.config.{key}: not a setting"
        if (component, key) in CHART_CHOICES:
            assert value != default_of(config, key), (
                f"{component}.config.{key} now equals the service default: drop it from "
                "CHART_CHOICES"
            )
        else:
            assert value == default_of(config, key), (
                f"{component}.config.{key}: {value!r} restates the service default "
                f"{default_of(config, key)!r} wrongly; follow it or list the chart's reason"
            )
    config(**chart_config(component))


def test_every_listed_choice_is_in_the_chart() -> None:
    for component, key in CHART_CHOICES:
        assert key in chart_config(component), f"{component}.config.{key} is gone from values"


def test_the_learner_listens_where_clients_look() -> None:
    assert chart_config("learner")["port"] == LEARNER_PORT
