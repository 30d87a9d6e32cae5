"""Prometheus `/metrics` for every service process, with `prometheus_client`.

Each service process exposes one registry (prometheus_client's default, with its process
collector) on its HTTP server's `/metrics`: request counts and latencies of every gRPC
method (an aio server interceptor in `marl.serving.ServiceHost`) and every HTTP route (an
aiohttp middleware in `marl.http_server.HttpServer`), plus what the service itself
knows: episodes in flight and task entries refused for their signature (workflow), adapter versions loaded and generation requests in
flight (inference), sandbox verdicts by kind (sandbox), the lag of the task stream
(workflow), and Redis's memory against its maxmemory (workflow). Values that live elsewhere (Redis) are read when Prometheus scrapes, by hooks a
service adds with `on_scrape`. Prometheus scrapes the port the service's HTTP server
listens on (`http_port`; the Helm chart's workflow pods serve it on 8080).

The learner exports each run's training as it logs its steps (`metric_sinks.TrainingGauges`):
`marl_run_step`, `marl_run_reward_mean`, `marl_run_val_accuracy`, `marl_run_failed_steps`
labelled by run, `marl_role_chi2_token`, `marl_role_update_chi2`, `marl_role_entropy`,
`marl_role_response_len` by run and role, and `marl_alarms_total` by run, role and
mechanism: the numbers of metrics.jsonl and `marl watch`, for dashboards and alert rules.

The two autoscaling signals (deploy/helm scales on them with KEDA's Prometheus scaler):
`marl_stream_lag` of `marl:tasks` for workflow workers, which every worker reports alike
(query it with `max`, not `sum`), and `marl_inference_requests_in_flight` for inference
replicas, one figure per replica (query it with `sum`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

REQUESTS = Counter(
    "marl_requests",
    "Requests served, by protocol, method and status code",
    ["protocol", "method", "code"],
)
LATENCY = Histogram(
    "marl_request_seconds",
    "Request latency in seconds (streams: until the last message)",
    ["protocol", "method"],
    buckets=(0.005, 0.025, 0.1, 0.5, 1, 2.5, 10, 30, 120, 600),
)
INFLIGHT_EPISODES = Gauge("marl_inflight_episodes", "Episodes this workflow worker runs now")
ADAPTER_VERSIONS = Gauge(
    "marl_adapter_versions_loaded", "Adapter versions this inference replica holds loaded"
)
INFERENCE_IN_FLIGHT = Gauge(
    "marl_inference_requests_in_flight",
    "Generation requests this inference replica serves now, queued or decoding (each request "
    "of a GenerateMany counts, and each OpenAI completion served with an adapter)",
)
TASKS_REFUSED = Counter(
    "marl_tasks_refused",
    "Task entries this workflow worker refused to run: unsigned or with a bad signature "
    "(forged into Redis by someone without the services' token), by reason",
    ["reason"],
)
SANDBOX_VERDICTS = Counter(
    "marl_sandbox_verdicts", "Sandbox test verdicts, by verdict", ["verdict"]
)
STREAM_LAG = Gauge(
    "marl_stream_lag",
    "Entries of a Redis stream its consumer group has not acknowledged (undelivered + pending)",
    ["stream", "group"],
)
"""Work waiting on a stream, from `marl.runtime.streams.backlog`: right on Redis 7 also after entries
past the group's position were deleted, where XINFO GROUPS' own `lag` is NULL (the entries
are then counted inside Redis), so autoscaling on it keeps working where a scaler that reads
`lag` (KEDA's redis-streams `lagCount`) gets nothing to use."""

REDIS_MEMORY_USED = Gauge(
    "marl_redis_memory_used_bytes", "Memory Redis uses (INFO memory used_memory)"
)
REDIS_MEMORY_MAX = Gauge(
    "marl_redis_memory_max_bytes",
    "Redis's maxmemory (0: none); past it a noeviction Redis refuses writes, so alert on "
    "used / max approaching 1",
)

RUN_STEP = Gauge("marl_run_step", "The run's last logged training step", ["run"])
RUN_REWARD_MEAN = Gauge(
    "marl_run_reward_mean", "Mean training reward of the run's last step", ["run"]
)
RUN_VAL_ACCURACY = Gauge(
    "marl_run_val_accuracy", "Validation accuracy at the run's last validation step", ["run"]
)
RUN_FAILED_STEPS = Gauge(
    "marl_run_failed_steps",
    "Steps of the run that lost more than train.max_failed_fraction of their episodes, "
    "since this learner took the run up",
    ["run"],
)
ROLE_CHI2_TOKEN = Gauge(
    "marl_role_chi2_token",
    "A role's token-level chi2 (learner vs sampler) at the run's last step",
    ["run", "role"],
)
ROLE_UPDATE_CHI2 = Gauge(
    "marl_role_update_chi2", "How far a role's policy moved during the run's last step (chi2)",
    ["run", "role"],
)
ROLE_ENTROPY = Gauge(
    "marl_role_entropy", "A role's mean token entropy at the run's last step", ["run", "role"]
)
ROLE_RESPONSE_LEN = Gauge(
    "marl_role_response_len", "A role's mean response length in tokens at the run's last step",
    ["run", "role"],
)
ALARMS = Counter(
    "marl_alarms", "Drift alarms fired, by run, role and mechanism", ["run", "role", "mechanism"]
)
RUN_SERIES = (RUN_STEP, RUN_REWARD_MEAN, RUN_VAL_ACCURACY, RUN_FAILED_STEPS)
ROLE_SERIES = {
    "chi2_token": ROLE_CHI2_TOKEN,
    "update_chi2": ROLE_UPDATE_CHI2,
    "entropy": ROLE_ENTROPY,
    "response_len_mean": ROLE_RESPONSE_LEN,
}
"""The learner's per-role gauges, by the metric of the step record (`role/<role>/<metric>`)
each one shows."""

log = logging.getLogger(__name__)

ScrapeHook = Callable[[], Awaitable[None]]
SCRAPE_HOOKS = web.AppKey("marl_scrape_hooks", list[ScrapeHook])
SCRAPE_HOOK_TIMEOUT_S = 2.0


def on_scrape(app: web.Application, hook: ScrapeHook) -> None:
    """Run `hook` (it sets gauges) before every /metrics answer; a failing or slow hook
    leaves its gauges at their last values."""
    app[SCRAPE_HOOKS].append(hook)


def stream_lag_hook(r: Any, stream: str, group: str) -> ScrapeHook:
    """A scrape hook that sets `marl_stream_lag` of `stream`'s consumer `group`."""
    from marl.runtime import streams

    async def stream_lag() -> None:
        STREAM_LAG.labels(stream, group).set(await streams.lag(r, stream, group))

    return stream_lag


def redis_memory_hook(r: Any) -> ScrapeHook:
    """A scrape hook that sets `marl_redis_memory_used_bytes` and `_max_bytes` from INFO."""

    async def redis_memory() -> None:
        info = await r.info("memory")
        REDIS_MEMORY_USED.set(int(info.get("used_memory", 0)))
        REDIS_MEMORY_MAX.set(int(info.get("maxmemory", 0)))

    return redis_memory


async def metrics_handler(request: web.Request) -> web.Response:
    for hook in request.app[SCRAPE_HOOKS]:
        try:
            async with asyncio.timeout(SCRAPE_HOOK_TIMEOUT_S):
                await hook()
        except Exception as err:  # a scrape must answer whatever Redis does
            log.warning("metrics hook %s failed: %s", getattr(hook, "__name__", hook), err)
    return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})


@web.middleware
async def http_metrics(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Count and time every HTTP request by its route (not its raw path: bounded labels)."""
    resource = request.match_info.route.resource
    method = f"{request.method} {resource.canonical if resource is not None else 'unmatched'}"
    started = time.monotonic()
    code = "500"
    try:
        response = await handler(request)
        code = str(response.status)
        return response
    except web.HTTPException as err:
        code = str(err.status)
        raise
    finally:
        REQUESTS.labels("http", method, code).inc()
        LATENCY.labels("http", method).observe(time.monotonic() - started)


def mount(app: web.Application) -> None:
    """`/metrics` and the request middleware on a service's aiohttp application."""
    app.middlewares.append(http_metrics)
    app[SCRAPE_HOOKS] = []
    app.router.add_get("/metrics", metrics_handler)


def _code(context: Any) -> str:
    code = context.code()
    return code.name if isinstance(code, grpc.StatusCode) else "OK"


class GrpcMetrics(grpc.aio.ServerInterceptor):
    """Counts and times every gRPC call by method and final status code."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        method = details.method

        def done(context: Any, started: float, failed: BaseException | None) -> None:
            if failed is None or isinstance(failed, grpc.aio.AbortError):
                code = _code(context)
            elif isinstance(failed, asyncio.CancelledError):
                code = "CANCELLED"
            else:
                code = "UNKNOWN"
            REQUESTS.labels("grpc", method, code).inc()
            LATENCY.labels("grpc", method).observe(time.monotonic() - started)

        def timed(inner: Any) -> Any:
            """A handler that returns one response (its request a message or a stream)."""

            async def call(request: Any, context: Any) -> Any:
                started, failed = time.monotonic(), None
                try:
                    return await inner(request, context)
                except BaseException as err:
                    failed = err
                    raise
                finally:
                    done(context, started, failed)

            return call

        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                timed(handler.unary_unary), handler.request_deserializer,
                handler.response_serializer,
            )
        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            inner_us = handler.unary_stream

            async def unary_stream(request: Any, context: Any) -> Any:
                started, failed = time.monotonic(), None
                try:
                    async for item in inner_us(request, context):
                        yield item
                except BaseException as err:
                    failed = err
                    raise
                finally:
                    done(context, started, failed)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, handler.request_deserializer, handler.response_serializer
            )
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                timed(handler.stream_unary), handler.request_deserializer,
                handler.response_serializer,
            )
        return handler  # streams written through context.write, and bidi ones: served untimed
