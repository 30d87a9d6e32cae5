"""Write deploy/helm/values.schema.json: the chart's values, strictly typed.

Each service's `config` block is generated from its pydantic model in
`marl.spec.services`, so the chart refuses exactly what `marl serve --config`
would refuse, and a field added to a model shows up here on the next run (a
test fails while the file is stale). Everything else is the chart's own
layout, spelled out below. Every object is closed (additionalProperties:
false): a misspelled key is an error, not a silently ignored setting.
Usage: .venv/bin/python scripts/gen_chart_schema.py [--check]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from marl.spec.services import MODELS  # noqa: E402

OUT = ROOT / "deploy" / "helm" / "values.schema.json"

DURATION = r"^([0-9]+(\.[0-9]+)?(ns|us|ms|s|m|h))+$"
QUANTITY = {"type": ["string", "number"], "pattern": r"^[0-9.]+([eE][0-9]+|[mkKMGTPE]i?)?$"}


def obj(
    props: dict[str, Any], desc: str | None = None, required: list[str] | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "additionalProperties": False, "properties": props}
    if desc:
        out["description"] = desc
    if required:
        out["required"] = required
    return out


def string(desc: str, **kw: Any) -> dict[str, Any]:
    return {"type": "string", "description": desc, **kw}


def integer(desc: str, minimum: int = 0, **kw: Any) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum, "description": desc, **kw}


def boolean(desc: str) -> dict[str, Any]:
    return {"type": "boolean", "description": desc}


def config_schema(service: str) -> dict[str, Any]:
    """The pydantic model's schema, titles dropped (they repeat the key)."""
    schema = MODELS[service].model_json_schema()  # type: ignore[index]
    assert "$defs" not in schema, f"{service}: nested models need inlining"
    for prop in schema["properties"].values():
        prop.pop("title", None)
    return {
        "type": "object",
        "additionalProperties": False,
        "description": f"{schema['title']} (marl/spec/services.py): {schema.get('description', '')}",
        "properties": schema["properties"],
    }


IMAGE = obj(
    {
        "repository": string("Image repository.", minLength=1),
        "tag": string("Image tag; empty = image.tag, else the chart's appVersion."),
    },
    required=["repository"],
)
RESOURCES = obj(
    {
        "requests": {"type": "object", "additionalProperties": QUANTITY},
        "limits": {"type": "object", "additionalProperties": QUANTITY},
    },
    "Container resources (requests/limits of cpu, memory, ...).",
)
SCHEDULING = {
    "nodeSelector": {
        "type": "object",
        "additionalProperties": {"type": "string"},
        "description": "Node labels the pods require.",
    },
    "tolerations": {
        "type": "array",
        "items": {"type": "object"},
        "description": "Pod tolerations.",
    },
    "affinity": {"type": "object", "description": "Pod affinity rules."},
}
PERSISTENCE = obj(
    {
        "size": {**QUANTITY, "description": "Volume size."},
        "storageClass": string("StorageClass; empty = the cluster default."),
    }
)


def hpa(desc: str) -> dict[str, Any]:
    return obj(
        {
            "enabled": boolean("Create a CPU HorizontalPodAutoscaler."),
            "minReplicas": integer("Fewest replicas.", 1),
            "maxReplicas": integer("Most replicas.", 1),
            "targetCPUUtilizationPercentage": integer("CPU use the HPA aims for.", 1, maximum=100),
        },
        desc,
    )


def keda_scaling(desc: str, extra: dict[str, Any]) -> dict[str, Any]:
    """A KEDA ScaledObject's knobs: `extra` (its trigger's) plus the replica bounds."""
    return obj(
        {
            "enabled": boolean("Scale with a KEDA ScaledObject instead."),
            **extra,
            "minReplicaCount": integer("Fewest replicas."),
            "maxReplicaCount": integer("Most replicas.", 1),
            "pollingInterval": integer("Seconds between checks.", 1),
            "cooldownPeriod": integer("Seconds before scaling to the minimum."),
            "query": string("PromQL in place of the chart's (prometheus triggers)."),
        },
        desc,
    )


def build() -> dict[str, Any]:
    inference = obj(
        {
            "replicas": integer("Inference replicas (when keda is off)."),
            "image": IMAGE,
            "gpu": integer("nvidia.com/gpu per replica; 0 = CPU."),
            "resources": RESOURCES,
            "startupSeconds": integer("Seconds a replica may take to load its model.", 10),
            "keda": keda_scaling(
                "KEDA scaling on generation requests in flight (Prometheus).",
                {"requestsPerReplica": integer("Requests in flight per replica.", 1)},
            ),
            "config": config_schema("inference"),
            **SCHEDULING,
        },
        "The inference Deployment.",
    )
    workflow = obj(
        {
            "replicas": integer("Replicas when no autoscaler is on."),
            "image": IMAGE,
            "resources": RESOURCES,
            "config": config_schema("workflow"),
            "egress": {
                "type": "array",
                "items": {"type": "object"},
                "description": "Extra NetworkPolicy egress rules for the workers (an "
                "external Redis, the judge endpoints' addresses).",
            },
            "autoscaling": hpa("CPU autoscaling (ignored when keda.enabled)."),
            "keda": keda_scaling(
                "KEDA scaling on the tasks stream's backlog.",
                {
                    "trigger": {
                        "enum": ["auto", "prometheus", "redis-streams"],
                        "description": "prometheus: marl_stream_lag (marl's count); "
                        "redis-streams: XINFO GROUPS lag (NULL after deletions on Redis 7); "
                        "auto: prometheus when prometheus.serverAddress is set.",
                    },
                    "lagCount": integer("Backlog per replica.", 1),
                    "operatorNamespace": string("KEDA operator's namespace (admitted to Redis)."),
                    "redisAddress": string("host:port KEDA polls; empty = the in-release Redis."),
                },
            ),
            **SCHEDULING,
        },
        "The workflow worker Deployment.",
    )
    sandbox = obj(
        {
            "enabled": boolean("Run the reward sandbox."),
            "replicas": integer("Replicas when autoscaling is off."),
            "image": IMAGE,
            "resources": RESOURCES,
            "scratchSize": {**QUANTITY, "description": "Size of the /tmp emptyDir."},
            "config": config_schema("sandbox"),
            "seccompProfile": obj(
                {
                    "type": {
                        "enum": ["RuntimeDefault", "Localhost"],
                        "description": "RuntimeDefault, or Localhost with localhostProfile.",
                    },
                    "localhostProfile": string("Profile path under the kubelet's seccomp root."),
                },
                "The sandbox pod's seccomp profile.",
                required=["type"],
            ),
            "autoscaling": hpa("CPU autoscaling."),
            **SCHEDULING,
        },
        "The reward sandbox Deployment.",
    )
    learner = obj(
        {
            "image": IMAGE,
            "replicas": integer(
                "Independent learners (each learner.nodes pods); each takes runs from the "
                "shared queue and trains up to config.max_concurrent_runs at once.",
                1,
            ),
            "nodes": {**integer("Pods of one learner's FSDP2 group.", 1), "maximum": 64},
            "gpu": {
                **integer("GPUs per learner pod, one rank each (0: one rank on the CPU)."),
                "maximum": 16,
            },
            "rendezvousPort": {
                **integer("Port of torch's c10d rendezvous on the learner's pod 0.", 1),
                "maximum": 65535,
            },
            "maxRestarts": integer(
                "Times a pod's launcher restarts its ranks when the group breaks.", 0
            ),
            "resources": RESOURCES,
            "config": config_schema("learner"),
            "persistence": obj(
                {
                    **PERSISTENCE["properties"],
                    "existingClaim": string(
                        "A ReadWriteMany claim every learner pod mounts at /data; empty = "
                        "one volume per pod."
                    ),
                }
            ),
            "podDisruptionBudget": obj(
                {
                    "enabled": boolean("Create a PodDisruptionBudget."),
                    "minAvailable": {
                        "type": ["integer", "string"],
                        "description": "Pods that must stay up (count or percentage).",
                    },
                }
            ),
            **SCHEDULING,
        },
        "The learner StatefulSet.",
    )
    redis = obj(
        {
            "enabled": boolean("Run Redis in the release."),
            "image": obj(
                {
                    "repository": string("Redis image.", minLength=1),
                    "tag": string("Redis image tag.", minLength=1),
                }
            ),
            "resources": RESOURCES,
            "maxmemory": string(
                "Redis maxmemory (policy noeviction), e.g. 3gb; below the memory limit.",
                pattern=r"^[1-9][0-9]*(kb|mb|gb)$",
            ),
            "persistence": PERSISTENCE,
            "external": obj(
                {
                    "url": string(
                        "redis://[:password@]host:port/db of an existing Redis.",
                        pattern=r"^$|^rediss?://",
                    )
                }
            ),
        },
        "Redis: in-release StatefulSet or external.",
    )
    schema = obj(
        {
            "nameOverride": string("Chart name override."),
            "fullnameOverride": string("Full name prefix override."),
            "image": obj(
                {
                    "registry": string("Registry prefixed to marl image repositories."),
                    "tag": string("Default tag for marl images."),
                    "pullPolicy": {
                        "enum": ["Always", "IfNotPresent", "Never"],
                        "description": "Image pull policy.",
                    },
                    "pullSecrets": {
                        "type": "array",
                        "items": {"type": "string"},
                        "description": "Image pull Secret names.",
                    },
                }
            ),
            "auth": obj(
                {
                    "enabled": boolean("Every service requires a known token (default on)."),
                    "token": string(
                        "The services' token (Redis requirepass); \"\": generated at install."
                    ),
                    "existingSecret": string("Existing Secret with key `token`."),
                    "users": obj(
                        {
                            "existingSecret": string(
                                "Secret with key tokens.csv: users' static token file."
                            ),
                        }
                    ),
                    "sandbox": obj(
                        {
                            "existingSecret": string(
                                "Secret with key `token`: the sandbox's own token."
                            ),
                        }
                    ),
                }
            ),
            "tls": obj(
                {
                    "enabled": boolean("TLS for every service and Redis; clients verify."),
                    "existingSecret": string("Secret with tls.crt, tls.key, ca.crt."),
                    "sandboxExistingSecret": string("The sandbox's own Secret."),
                    "serverName": string("Name checked for servers dialled at an IP."),
                    "extraDnsNames": {
                        "type": "array",
                        "items": {"type": "string", "minLength": 1},
                        "description": "More DNS names for the shared certificate.",
                    },
                    "certManager": obj(
                        {
                            "enabled": boolean("Have cert-manager issue the Secrets."),
                            "issuerRef": obj(
                                {
                                    "name": string("Issuer name."),
                                    "kind": {
                                        "enum": ["Issuer", "ClusterIssuer"],
                                        "description": "Issuer kind.",
                                    },
                                    "group": string("Issuer API group.", minLength=1),
                                }
                            ),
                            "duration": string(
                                "Certificate lifetime (Go duration).", pattern=DURATION
                            ),
                            "renewBefore": string("Renewal lead (Go duration).", pattern=DURATION),
                        }
                    ),
                },
                "TLS between every component.",
            ),
            "prometheus": obj(
                {
                    "serverAddress": string(
                        "Prometheus URL the KEDA prometheus triggers query.",
                        pattern=r"^$|^https?://",
                    ),
                    "namespace": string("Prometheus's namespace, admitted to /metrics ports."),
                    "podMonitor": obj(
                        {
                            "enabled": boolean("PodMonitors for workflow and inference."),
                            "interval": string("Scrape interval.", pattern=DURATION),
                        }
                    ),
                },
                "Prometheus: where KEDA queries it, and how it reaches the pods.",
            ),
            "grafana": obj(
                {
                    "dashboard": obj(
                        {
                            "enabled": boolean("A ConfigMap with marl's Grafana dashboard."),
                            "labels": {
                                "type": "object",
                                "additionalProperties": {"type": "string"},
                                "description": "Labels the Grafana sidecar selects by.",
                            },
                            "namespace": string("Namespace of the ConfigMap (\"\" = release's)."),
                        }
                    ),
                },
                "Grafana: marl's dashboard for its sidecar.",
            ),
            "networkPolicy": obj(
                {
                    "enabled": boolean("NetworkPolicies for every component."),
                    "clients": obj(
                        {
                            "podLabels": {
                                "type": "object",
                                "additionalProperties": {"type": "string"},
                                "description": "Labels of pods that reach the user-facing ports.",
                            },
                            "namespaces": {
                                "type": "array",
                                "items": {"type": "string", "minLength": 1},
                                "description": "Namespaces whose pods reach them too.",
                            },
                        }
                    ),
                }
            ),
            "models": obj({"existingClaim": string("PVC with base models, mounted at /models.")}),
            "inference": inference,
            "workflow": workflow,
            "sandbox": sandbox,
            "learner": learner,
            "redis": redis,
        }
    )
    return {"$schema": "http://json-schema.org/draft-07/schema#", **schema}


def main(argv: list[str]) -> int:
    text = json.dumps(build(), indent=2) + "\n"
    if argv == ["--check"]:
        if OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run scripts/gen_chart_schema.py")
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
