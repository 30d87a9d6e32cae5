"""The `marl.v1.Sandbox` gRPC servicer: validation, admission, and the wire format.

Malformed requests are refused with INVALID_ARGUMENT naming the field. At most
`max_concurrency` jobs run and `max_queue` wait; anything beyond is refused at
once with RESOURCE_EXHAUSTED, never queued without bound. A job's time is
bounded by its tests' timeouts and by the client's deadline, and a cancelled
call kills its job (see `executor`). `run_job` is that admission, shared with the
SandboxFusion HTTP front end (`http_api`), so both protocols fill the same slots
and are refused the same way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import grpc

from marl.protocol.v1 import sandbox_pb2, sandbox_pb2_grpc
from marl.runtime.prometheus_metrics import SANDBOX_VERDICTS
from marl.spec.services import SandboxConfig

from . import jobspec, tiers
from .executor import Executor, JobResult
from .forkserver_client import ZygoteError
from .jobspec import Job

log = logging.getLogger(__name__)
_DEADLINE_MARGIN = 0.1


class SandboxStarting(Exception):
    """No job can run yet: the zygote is still detecting the tier."""


class SandboxBusy(Exception):
    """Every slot is taken and the queue is full; the caller should retry later."""


class SandboxService(sandbox_pb2_grpc.SandboxServicer):
    def __init__(self, cfg: SandboxConfig):
        self.cfg = cfg
        self.executor: Executor | None = None
        self.report: dict[str, Any] = {"tier": "", "probes": {}}
        self.slots = asyncio.Semaphore(cfg.max_concurrency)
        self.admitted = 0

    def attach(self, executor: Executor, report: dict[str, Any]) -> None:
        """Start accepting jobs, once the zygote has detected the tier."""
        self.executor = executor
        self.report = report

    async def run_job(self, job: Job,
                      time_left: Callable[[], float | None] = lambda: None) -> JobResult:
        """Run a validated job under admission control; `time_left` is asked once a slot is free.

        Raises SandboxStarting, SandboxBusy (refused at once, never queued past
        `max_queue`) or ZygoteError (the job was lost with its zygote).
        """
        if self.executor is None:
            raise SandboxStarting("sandbox is still starting")
        if self.admitted >= self.cfg.max_concurrency + self.cfg.max_queue:
            raise SandboxBusy(f"sandbox busy: {self.cfg.max_concurrency} jobs running and "
                              f"{self.cfg.max_queue} queued; retry later")
        self.admitted += 1
        try:
            async with self.slots:
                assert self.executor is not None
                result = await self.executor.run(job, time_left())
        finally:
            self.admitted -= 1
        for r in result.results:
            SANDBOX_VERDICTS.labels(r.verdict).inc()
        return result

    async def Execute(self, request: sandbox_pb2.ExecuteRequest,
                      context: grpc.aio.ServicerContext) -> sandbox_pb2.ExecuteResponse:
        try:
            job = jobspec.parse(request, self.cfg)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

        def time_left() -> float | None:
            remaining = context.time_remaining()
            return None if remaining is None else remaining - _DEADLINE_MARGIN

        try:
            result = await self.run_job(job, time_left)
        except SandboxStarting as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except SandboxBusy as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except ZygoteError as e:
            log.error("job lost: %s", e)
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"{e}; it is being restarted, retry the call")
        return sandbox_pb2.ExecuteResponse(
            results=[sandbox_pb2.TestResult(verdict=sandbox_pb2.Verdict.Value(r.verdict),
                                            stdout=r.stdout, stderr=r.stderr,
                                            seconds=r.seconds, error=r.error)
                     for r in result.results],
            pass_rate=result.pass_rate, isolation_tier=result.tier)

    async def Info(self, request: sandbox_pb2.InfoRequest,
                   context: grpc.aio.ServicerContext) -> sandbox_pb2.InfoResponse:
        cfg = self.cfg
        tier = self.report["tier"]
        return sandbox_pb2.InfoResponse(
            isolation_tier=tier,
            layers=[sandbox_pb2.IsolationLayer(name=n, protects=p) for n, p in tiers.layers(tier)],
            not_protected=tiers.NOT_PROTECTED,
            probes=self.report.get("probes", {}),
            default_limits=sandbox_pb2.Limits(timeout_seconds=cfg.default_timeout_seconds,
                                              memory_bytes=cfg.default_memory_bytes,
                                              output_bytes=cfg.default_output_bytes),
            max_limits=sandbox_pb2.Limits(timeout_seconds=cfg.max_timeout_seconds,
                                          memory_bytes=cfg.max_memory_bytes,
                                          output_bytes=cfg.max_output_bytes),
            max_concurrency=cfg.max_concurrency, max_queue=cfg.max_queue)
