"""`marl cluster`: a Helm release of marl seen through the Kubernetes API.

    marl cluster status [--json]          pods per service, ready or not, tasks stream lag
    marl cluster scale workflow|sandbox N
    marl cluster logs SERVICE [--tail N] [--follow]

Uses the current kubeconfig (or --kubeconfig/--context) with the `kubernetes`
client, and finds the release's objects by the chart's labels
(`app.kubernetes.io/part-of=marl`, `app.kubernetes.io/instance=RELEASE`,
`app.kubernetes.io/component=SERVICE`), never by guessing names. The tasks
stream's lag is read with `redis-cli XINFO GROUPS` run in the release's Redis
pod (an exec, so no port-forward is needed); with an external Redis pass
--redis URL instead. Where the group reports no lag (Redis 6, or Redis 7 once the
learner has deleted tasks past the group's last delivery, which it does at every
step), the undelivered tasks are counted inside Redis (`marl.runtime.streams.count_after`'s
script) in a second call. A deployment that an autoscaler (HPA or KEDA) manages is
not scaled by hand: the autoscaler would undo it within seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

SERVICES = ("inference", "workflow", "sandbox", "learner", "redis")
SCALABLE = ("workflow", "sandbox")
REQUEST_TIMEOUT_S = 20


class ClusterError(Exception):
    """A problem the user can fix (no kubeconfig, no such release, API refused); exit 2."""


@dataclass
class PodState:
    name: str
    phase: str
    ready: bool
    restarts: int


@dataclass
class ServiceState:
    service: str
    pods: list[PodState] = field(default_factory=list)

    @property
    def ready(self) -> int:
        return sum(p.ready for p in self.pods)


@dataclass
class StreamLag:
    waiting: int | None
    """Tasks not yet delivered to any worker (Redis 7's `lag`); None when unknown."""
    pending: int
    """Tasks delivered to a worker and not yet acknowledged."""
    consumers: int


class HelmRelease:
    """The API clients for one kubeconfig context, scoped to a namespace and a release."""

    def __init__(
        self,
        namespace: str | None,
        name: str,
        kubeconfig: str | None = None,
        context: str | None = None,
    ):
        try:
            from kubernetes import client, config
            from kubernetes.config.config_exception import ConfigException
        except ImportError:
            raise ClusterError(
                "marl cluster needs the Kubernetes client: pip install 'marl[cluster]'"
            ) from None

        # the client reads $KUBECONFIG once, at import; read it per call like kubectl does
        kubeconfig = kubeconfig or os.environ.get("KUBECONFIG") or None
        configuration = client.Configuration()
        try:
            config.load_kube_config(
                config_file=kubeconfig, context=context, client_configuration=configuration
            )
            _, active = config.list_kube_config_contexts(config_file=kubeconfig)
        except (ConfigException, FileNotFoundError) as err:
            raise ClusterError(f"--kubeconfig: cannot load a Kubernetes config ({err})") from None
        if context is None:
            context_ns = (active or {}).get("context", {}).get("namespace")
        else:
            contexts, _ = config.list_kube_config_contexts(config_file=kubeconfig)
            match = [c for c in contexts if c["name"] == context]
            context_ns = match[0]["context"].get("namespace") if match else None
        configuration.retries = 1
        self.api = client.ApiClient(configuration)
        self.core = client.CoreV1Api(self.api)
        self.apps = client.AppsV1Api(self.api)
        self.autoscaling = client.AutoscalingV2Api(self.api)
        self.namespace = namespace or context_ns or "default"
        self.name = name
        self.host = configuration.host

    def selector(self, service: str | None = None) -> str:
        parts = ["app.kubernetes.io/part-of=marl", f"app.kubernetes.io/instance={self.name}"]
        if service:
            parts.append(f"app.kubernetes.io/component={service}")
        return ",".join(parts)

    def call(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        """One API call with a deadline; API and connection failures become ClusterError."""
        from kubernetes.client.rest import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return method(*args, _request_timeout=REQUEST_TIMEOUT_S, **kwargs)
        except ApiException as err:
            reason = _api_reason(err)
            raise ClusterError(f"the Kubernetes API refused ({err.status}): {reason}") from None
        except HTTPError as err:
            raise ClusterError(f"cannot reach the Kubernetes API at {self.host}: {err}") from None

    # ------------------------------------------------------------ status

    def services(self) -> dict[str, ServiceState]:
        pods = self.call(
            self.core.list_namespaced_pod, self.namespace, label_selector=self.selector()
        ).items
        out = {s: ServiceState(s) for s in SERVICES}
        for pod in pods:
            service = (pod.metadata.labels or {}).get("app.kubernetes.io/component", "?")
            statuses = pod.status.container_statuses or []
            ready = (
                pod.status.phase == "Running" and bool(statuses) and all(c.ready for c in statuses)
            )
            out.setdefault(service, ServiceState(service)).pods.append(
                PodState(
                    name=pod.metadata.name,
                    phase=pod.status.phase or "Unknown",
                    ready=ready,
                    restarts=sum(c.restart_count for c in statuses),
                )
            )
        return out

    def lag_via_exec(self) -> StreamLag | None:
        """XINFO GROUPS in the release's Redis pod; None when the release runs no Redis."""
        from marl.runtime.streams import COUNT_AFTER_LIMIT, COUNT_AFTER_SCRIPT, TASKS

        pods = self.call(
            self.core.list_namespaced_pod, self.namespace, label_selector=self.selector("redis")
        ).items
        running = [p for p in pods if p.status.phase == "Running"]
        if not running:
            return None
        pod = running[0].metadata.name
        group = parse_xinfo_groups(self.redis_cli(pod, ["XINFO", "GROUPS", TASKS]))
        lag = group.lag
        if lag.waiting is None and group.last_delivered is not None:
            counted = self.redis_cli(pod, ["EVAL", COUNT_AFTER_SCRIPT, "1", TASKS,
                                           f"({group.last_delivered}", str(COUNT_AFTER_LIMIT)])
            lag.waiting = parse_count(counted)
        return lag

    def redis_cli(self, pod: str, args: list[str]) -> str:
        """redis-cli's raw output of one command in the Redis container of `pod`."""
        from kubernetes.stream import stream

        script = 'redis-cli --no-auth-warning ${MARL_AUTH_TOKEN:+-a "$MARL_AUTH_TOKEN"} ' + (
            " ".join(shlex.quote(a) for a in args)
        )
        try:
            text = stream(
                self.core.connect_get_namespaced_pod_exec,
                pod,
                self.namespace,
                command=["sh", "-c", script],
                container="redis",
                stderr=True,
                stdin=False,
                stdout=True,
                tty=False,
                _request_timeout=REQUEST_TIMEOUT_S,
            )
        except Exception as err:  # the websocket layer raises several unrelated types
            raise ClusterError(f"cannot exec in {pod}: {err}") from None
        return str(text)

    def scale(self, service: str, replicas: int) -> str:
        deployments = self.call(
            self.apps.list_namespaced_deployment,
            self.namespace,
            label_selector=self.selector(service),
        ).items
        if not deployments:
            raise ClusterError(
                f"no {service} Deployment of release {self.name!r} in namespace "
                f"{self.namespace!r} (check --release and -n)"
            )
        name = deployments[0].metadata.name
        hpas = self.call(
            self.autoscaling.list_namespaced_horizontal_pod_autoscaler, self.namespace
        ).items
        for hpa in hpas:
            if hpa.spec.scale_target_ref.name == name:
                raise ClusterError(
                    f"{name} is managed by the autoscaler {hpa.metadata.name} "
                    f"({hpa.spec.min_replicas}-{hpa.spec.max_replicas} replicas), which would undo "
                    f"a manual scale; change {service}.autoscaling (or keda) in the release's values"
                )
        self.call(
            self.apps.patch_namespaced_deployment_scale,
            name,
            self.namespace,
            {"spec": {"replicas": replicas}},
        )
        return str(name)

    def logs(self, service: str, tail: int | None) -> list[tuple[str, str]]:
        pods = self.call(
            self.core.list_namespaced_pod, self.namespace, label_selector=self.selector(service)
        ).items
        if not pods:
            raise ClusterError(
                f"no {service} pods of release {self.name!r} in namespace {self.namespace!r}"
            )
        out = []
        for pod in sorted(pods, key=lambda p: p.metadata.name):
            text = self.call(
                self.core.read_namespaced_pod_log,
                pod.metadata.name,
                self.namespace,
                tail_lines=tail,
            )
            out.append((pod.metadata.name, text))
        return out

    def follow(self, service: str, tail: int | None) -> None:
        """Stream one pod's log (the first by name) until interrupted."""
        pods = self.call(
            self.core.list_namespaced_pod, self.namespace, label_selector=self.selector(service)
        ).items
        if not pods:
            raise ClusterError(f"no {service} pods of release {self.name!r}")
        name = sorted(p.metadata.name for p in pods)[0]
        # unpreloaded, the client hands back the raw urllib3 response to stream from
        resp: Any = self.core.read_namespaced_pod_log(
            name, self.namespace, follow=True, tail_lines=tail, _preload_content=False
        )
        for chunk in resp.stream():
            sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()


def _api_reason(err: Any) -> str:
    try:
        return str(json.loads(err.body).get("message", err.reason))
    except (TypeError, ValueError, AttributeError):
        return str(err.reason)


@dataclass
class WorkersGroup:
    lag: StreamLag
    last_delivered: str | None
    """The group's last delivered entry id: the undelivered tasks are those after it."""


def parse_xinfo_groups(text: str) -> WorkersGroup:
    """redis-cli's raw XINFO GROUPS output (alternating key and value lines), our group only."""
    from marl.runtime.streams import WORKERS_GROUP

    if "no such key" in text.lower():
        return WorkersGroup(StreamLag(waiting=0, pending=0, consumers=0), None)
    if text.startswith(("ERR", "NOAUTH", "WRONGPASS")):
        raise ClusterError(f"redis-cli in the Redis pod: {text.strip()}")
    lines = [line.strip() for line in text.strip().splitlines()]
    groups: list[dict[str, str]] = []
    for key, value in zip(lines[::2], lines[1::2], strict=False):
        if key == "name":
            groups.append({})
        if groups:
            groups[-1][key] = value
    for group in groups:
        if group.get("name") == WORKERS_GROUP:
            lag = group.get("lag")
            return WorkersGroup(
                StreamLag(
                    waiting=int(lag) if lag not in (None, "", "(nil)") else None,
                    pending=int(group.get("pending", 0)),
                    consumers=int(group.get("consumers", 0)),
                ),
                group.get("last-delivered-id") or None,
            )
    return WorkersGroup(StreamLag(waiting=None, pending=0, consumers=0), None)


def parse_count(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ClusterError(f"redis-cli in the Redis pod: {text.strip()}") from None


def lag_via_redis(url: str) -> StreamLag:
    """The backlog as the services read it (`marl.runtime.streams.backlog`), without their
    retries: a wrong URL fails at once."""
    import asyncio

    import redis
    import redis.asyncio as aioredis

    from marl.runtime import streams

    async def read() -> streams.Backlog | None:
        async with aioredis.Redis.from_url(url, decode_responses=True, socket_timeout=10) as r:
            return await streams.backlog(r, streams.TASKS, streams.WORKERS_GROUP)

    try:
        got = asyncio.run(read())
    except redis.ConnectionError as err:
        raise ClusterError(f"--redis: cannot connect to {url}: {err}") from None
    except redis.RedisError as err:
        raise ClusterError(f"--redis: {err}") from None
    if got is None:  # no tasks stream (or group) yet: nothing queued
        return StreamLag(waiting=0, pending=0, consumers=0)
    return StreamLag(waiting=got.undelivered, pending=got.pending, consumers=got.consumers)


# ------------------------------------------------------------------ command


def add_parser(sub: Any) -> None:
    p = sub.add_parser("cluster", help="a Helm release of marl on Kubernetes: status, scale, logs")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION",
                               help="status, scale or logs")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-n", "--namespace", default=None, help="default: the context's")
    common.add_argument("--release", default="marl", help="Helm release name (default marl)")
    common.add_argument("--kubeconfig", default=None, help="default: $KUBECONFIG or ~/.kube/config")
    common.add_argument("--context", default=None, help="kubeconfig context (default: current)")
    s = actions.add_parser("status", parents=[common], help="pods per service and the tasks lag")
    s.add_argument("--json", action="store_true", help="one JSON object")
    s.add_argument("--redis", default=None, help="read the lag from this Redis URL instead")
    s = actions.add_parser("scale", parents=[common], help="set workflow or sandbox replicas")
    s.add_argument("service", choices=SCALABLE, help="the Deployment to scale")
    s.add_argument("replicas", type=int, help="the number of pods it gets")
    s = actions.add_parser("logs", parents=[common], help="a service's pod logs")
    s.add_argument("service", choices=SERVICES, help="whose pods' logs")
    s.add_argument("--tail", type=int, default=100, help="lines per pod (default 100)")
    s.add_argument("-f", "--follow", action="store_true", help="stream the first pod's log")


def run(args: argparse.Namespace) -> int:
    if args.action == "scale" and args.replicas < 0:
        raise ClusterError("replicas: must be >= 0")
    release = HelmRelease(args.namespace, args.release, args.kubeconfig, args.context)
    if args.action == "status":
        return _status(release, args.json, args.redis)
    if args.action == "scale":
        name = release.scale(args.service, args.replicas)
        print(f"{name}: scaled to {args.replicas} replicas")
        return 0
    if args.follow:
        release.follow(args.service, args.tail)
        return 0
    for pod, text in release.logs(args.service, args.tail):
        for line in text.splitlines():
            print(f"[{pod}] {line}")
    return 0


def _status(release: HelmRelease, as_json: bool, redis_url: str | None) -> int:
    services = release.services()
    lag = lag_via_redis(redis_url) if redis_url else release.lag_via_exec()
    if as_json:
        print(
            json.dumps(
                {
                    "namespace": release.namespace,
                    "release": release.name,
                    "services": {
                        s: {"ready": st.ready, "pods": [asdict(p) for p in st.pods]}
                        for s, st in services.items()
                    },
                    "tasks": asdict(lag) if lag else None,
                },
                indent=2,
            )
        )
        return 0
    print(f"release {release.name} in namespace {release.namespace}")
    for name, st in services.items():
        if not st.pods and name == "redis":
            continue
        print(f"  {name:<10} {st.ready}/{len(st.pods)} ready")
        for pod in st.pods:
            mark = "ready" if pod.ready else "NOT READY"
            print(f"    {pod.name}  {pod.phase}  {mark}  restarts {pod.restarts}")
    if lag is None:
        print("  tasks      lag unknown (no Redis pod in the release: pass --redis URL)")
    else:
        waiting = "?" if lag.waiting is None else str(lag.waiting)
        print(f"  tasks      {waiting} waiting, {lag.pending} pending on {lag.consumers} workers")
    return 0
