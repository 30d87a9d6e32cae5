"""The Workflow gRPC service plus the Redis task loop, in one process."""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import uuid
from typing import Any

import grpc
from pydantic import TypeAdapter, ValidationError

from marl.protocol.v1 import workflow_pb2, workflow_pb2_grpc
from marl.rollout import Task
from marl.runtime import replicas, streams
from marl.runtime.http_server import HttpServer
from marl.runtime.prometheus_metrics import (
    INFLIGHT_EPISODES,
    on_scrape,
    redis_memory_hook,
    stream_lag_hook,
)
from marl.runtime.serving import ServiceHost, configure_logging, serve_until_stopped
from marl.runtime.task_signing import TaskSigner
from marl.spec.code_refs import CodePolicy
from marl.spec.safe_input import check_path, load_json, shorten
from marl.spec.services import WorkflowConfig, auth_token
from marl.workflows import resolve
from services.workflow.user_code import task_factory
from services.workflow.worker import ALLOWED_MODULES, EpisodeRunner, work_loop

_TASK = TypeAdapter(Task)
REFUSED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
           grpc.StatusCode.NOT_FOUND)
"""Codes by which inference says a caller's request (not marl) is wrong: passed on."""


def parse_task(task_json: str, code: CodePolicy | None = None) -> Task:
    """A caller's task, fully typed and complete, naming only code `code` allows (by
    default installed code only), or a ValueError naming the field."""
    data = load_json(task_json, "task_json")
    try:
        task = _TASK.validate_python(data)
    except ValidationError as err:
        e = err.errors()[0]
        where = ".".join(str(p) for p in e["loc"]) or "(task)"
        raise ValueError(f"task_json: field `{shorten(where, 100)}`: {e['msg']}"
                         + (f" and {err.error_count() - 1} more" if err.error_count() > 1 else "")
                         ) from None
    for name, value, low, high in (("temperature", task.temperature, 0.0, 100.0),
                                   ("top_p", task.top_p, 0.0, 1.0),
                                   ("max_tokens", task.max_tokens, 1, 1 << 20),
                                   ("seed", task.seed, 0, (1 << 63) - 1),
                                   ("math_timeout_s", task.math_timeout_s, 0.001, 3600.0),
                                   ("format_penalty", task.format_penalty, -1e6, 1e6)):
        if not (math.isfinite(value) and low <= value <= high):
            raise ValueError(f"task_json: field `{name}`: must be in {low}..{high}, "
                             f"got {shorten(value)}")
    workflow = resolve(task.workflow, code or CodePolicy(setting=ALLOWED_MODULES))
    # (a SpecError, a ValueError, names the field and the setting)
    missing = [r for r in workflow.roles if r not in task.adapters]
    if missing:
        raise ValueError(f"task_json: field `adapters`: no adapter for role(s) "
                         f"{', '.join(missing)} of workflow {task.workflow!r}")
    return task


async def served_model_problem(r: Any, model_path: Any) -> str | None:
    """Why this worker will not load `model_path` for a caller, or None.

    A worker loads only models its operator configured, i.e. the base model an inference
    replica was started with (announced in the replica registry): never a path or hub
    name a caller sends, which could make it read any file (`/etc/passwd`) as a config
    or reach out to a model hub.
    """
    if not isinstance(model_path, str) or not model_path:
        return "task_json: model_path must be the served base model's directory"
    try:
        wanted = os.path.realpath(check_path(model_path, "task_json: model_path"))
    except ValueError as err:
        return str(err)
    live = await replicas.live(r, "inference")
    served = sorted({str(info["model_path"]) for info in live.values() if info.get("model_path")})
    if wanted in {os.path.realpath(p) for p in served}:
        return None
    return (f"task_json: model_path {shorten(model_path)!r} is not the base model of any live "
            f"inference replica (served: {', '.join(shorten(p) for p in served) or 'none'}); "
            "a worker loads only models its operator started inference with")


class WorkflowService(workflow_pb2_grpc.WorkflowServicer):
    def __init__(self, runner: EpisodeRunner):
        self.runner = runner

    async def RunEpisode(
        self, request: workflow_pb2.RunEpisodeRequest, context: grpc.aio.ServicerContext
    ) -> workflow_pb2.RunEpisodeResponse:
        try:
            task = parse_task(request.task_json, self.runner.code)
            self.runner.check_names(task)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        problem = await served_model_problem(self.runner.redis, task.model_path)
        if problem is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        try:
            rollout = await self.runner.run(task)
        except grpc.aio.AioRpcError as err:  # inference refused what the caller asked for
            if err.code() not in REFUSED:
                raise
            await context.abort(err.code(), f"inference refused the episode's request: "
                                            f"{err.details()}")
        return workflow_pb2.RunEpisodeResponse(rollout_json=json.dumps(rollout.to_dict()))

    async def GetStats(
        self, request: workflow_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> workflow_pb2.GetStatsResponse:
        s = self.runner.stats
        return workflow_pb2.GetStatsResponse(
            episodes_done=s.done,
            episodes_failed=s.failed,
            in_flight=s.in_flight,
            mean_episode_seconds=s.total_seconds / s.done if s.done else 0.0,
            worker_id=self.runner.worker_id,
            episodes_withdrawn=s.withdrawn,
        )


async def _serve(cfg: WorkflowConfig) -> None:
    name = workflow_pb2.DESCRIPTOR.services_by_name["Workflow"].full_name
    server = ServiceHost([name], cfg.host, cfg.port)
    r = streams.connect(cfg.redis)
    signer = TaskSigner(auth_token())  # with the services' token, only signed tasks run
    # host and pid make a consumer in XINFO traceable to its pod and process
    worker_id = f"workflow-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    runner = EpisodeRunner(r, worker_id, cfg.sandbox, replica_wait_s=cfg.replica_wait_s,
                           code=CodePolicy(tuple(cfg.allowed_modules), ALLOWED_MODULES),
                           judge_endpoints=cfg.judge_endpoints)
    # a workflow's gathered coroutines that raise SystemExit fail their episode, not the loop
    asyncio.get_running_loop().set_task_factory(task_factory)
    workflow_pb2_grpc.add_WorkflowServicer_to_server(WorkflowService(runner), server.server)
    INFLIGHT_EPISODES.set_function(lambda: runner.stats.in_flight)
    http = None
    if cfg.http_port is not None:  # Prometheus /metrics
        http = HttpServer(cfg.host, cfg.http_port)
        on_scrape(http.app, stream_lag_hook(r, streams.TASKS, streams.WORKERS_GROUP))
        on_scrape(http.app, redis_memory_hook(r))
        await http.start()

    async def ready() -> None:
        from marl.rewards import math_scoring as math_reward

        await r.ping()
        await asyncio.to_thread(math_reward.warm_up)

    async def loop() -> None:
        await work_loop(runner, cfg, stopping=lambda: server.stopping, signer=signer)

    async def on_stop() -> None:
        if http is not None:
            await http.stop()
        await runner.close()
        await r.aclose()

    await serve_until_stopped(
        server, ready=ready, background=[loop], on_stop=on_stop, drain_s=cfg.drain_s + 1.0
    )


def run(cfg: WorkflowConfig) -> None:
    """Serve until SIGTERM/SIGINT, taking tasks from `cfg.redis`; blocking."""
    configure_logging("workflow")
    asyncio.run(_serve(cfg))
