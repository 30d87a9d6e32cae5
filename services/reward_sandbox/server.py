"""`marl serve sandbox`: the reward sandbox as a standalone gRPC server.

No Redis, no model, no torch. Start-up: load the config, start the zygote,
which detects the isolation tier; health turns SERVING only then. The tier is
printed, returned by the `Info` RPC and in every ExecuteResponse, and published
as a health entry named `marl.v1.Sandbox/isolation=<tier>` (SERVING), so a
plain health probe can check it. With `--http-port` (`http_port`) the same jobs
are also taken over HTTP as SandboxFusion's `POST /run_code` (see `http_api`). The server makes itself non-dumpable so a job
running under the same uid cannot read its memory or /proc/<pid>/environ. It accepts
only its own token (`$MARL_SANDBOX_TOKEN`) and refuses to start holding the services'
token (`marl.spec.services.sandbox_holds_no_service_token`), so code that escapes a job
finds no token that directs another service.

MARL_SANDBOX_SABOTAGE=1 switches every protection off (see `naive`); it exists
only so CI can prove that the deny tests detect a naive grader.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import tempfile
from typing import Any

from grpc_health.v1 import health_pb2

from marl.protocol.v1 import sandbox_pb2, sandbox_pb2_grpc
from marl.runtime import auth
from marl.runtime.http_server import HttpServer
from marl.runtime.serving import ServiceHost, configure_logging, serve_until_stopped
from marl.spec.services import SandboxConfig, add_flags, flag_values, load_sandbox

from . import http_api, syscalls
from .executor import Executor
from .forkserver_client import ZygoteClient
from .service import SandboxService

log = logging.getLogger(__name__)
SERVICE_NAME = sandbox_pb2.DESCRIPTOR.services_by_name["Sandbox"].full_name
SABOTAGE_ENV = "MARL_SANDBOX_SABOTAGE"


def sabotage_requested() -> bool:
    return os.environ.get(SABOTAGE_ENV, "") not in ("", "0")


def zygote_config(cfg: SandboxConfig, sabotage: bool) -> dict[str, object]:
    return {"isolation": cfg.isolation, "tmp_bytes": cfg.tmp_bytes,
            "tmp_inodes": cfg.tmp_inodes, "max_processes": cfg.max_processes,
            "warm_jails": cfg.warm_jails, "max_memory_bytes": cfg.max_memory_bytes,
            "max_jobs": cfg.max_concurrency + cfg.warm_jails + 1, "sabotage": sabotage}


def below_seccomp_problem(isolation: str, report: dict[str, Any]) -> None:
    """ValueError when `isolation: auto` found nothing stronger than `rlimits`: jobs would
    run with no network, exec or fork filter, which only an explicit `isolation: rlimits`
    may choose."""
    if isolation == "auto" and report["tier"] == "rlimits":
        probes = report.get("probes") or {}
        why = "; ".join(f"{k}: {v}" for k, v in probes.items() if v != "ok")
        raise ValueError(
            "isolation: auto found no tier stronger than rlimits on this host "
            f"({why or 'no probe passed'}); jobs would run with no network, exec or fork "
            "filter. Allow seccomp (and namespaces) to the sandbox, or set isolation: "
            "rlimits to run without them"
        )


async def serve(cfg: SandboxConfig, host: str, port: int) -> None:
    sabotage = sabotage_requested()
    if sabotage:
        log.warning("%s is set: ISOLATION IS OFF. Test use only.", SABOTAGE_ENV)
    else:
        syscalls.prctl(syscalls.PR_SET_DUMPABLE, 0)
    # its own token only: the services' token never reaches this process
    service_host = ServiceHost([SERVICE_NAME], host=host, port=port,
                               books=auth.sandbox_token_book)
    service = SandboxService(cfg)
    sandbox_pb2_grpc.add_SandboxServicer_to_server(service, service_host.server)
    zygote = ZygoteClient(zygote_config(cfg, sabotage))
    own_scratch = cfg.scratch_root is None
    scratch_root = cfg.scratch_root or tempfile.mkdtemp(prefix="marl-sandbox-")
    os.makedirs(scratch_root, exist_ok=True)
    os.chmod(scratch_root, 0o711)
    http = None
    if cfg.http_port is not None:  # SandboxFusion's POST /run_code, same admission and jails
        http = HttpServer(host, cfg.http_port, books=auth.sandbox_token_book)
        http_api.add_routes(http, service)
        await http.start()

    async def ready() -> None:
        report = await zygote.start()
        tier = report["tier"]
        print(f"isolation tier: {tier}", flush=True)
        for name, result in report.get("probes", {}).items():
            if result != "ok":
                log.warning("isolation tier %s unavailable: %s", name, result)
        below_seccomp_problem(cfg.isolation, report)
        log.info("isolation tier in force: %s (writes confined to the job's scratch by "
                 "Landlock: %s)", tier, "yes" if report.get("landlock") else "no")
        service.attach(Executor(zygote, tier, scratch_root, cfg.job_overhead_seconds), report)
        await service_host.health.set(f"{SERVICE_NAME}/isolation={tier}",
                                      health_pb2.HealthCheckResponse.SERVING)

    async def on_stop() -> None:
        if http is not None:
            await http.stop()
        zygote.close()
        if own_scratch:
            shutil.rmtree(scratch_root, ignore_errors=True)

    await serve_until_stopped(service_host, ready=ready, on_stop=on_stop)


def run(cfg: SandboxConfig) -> None:
    """Serve until SIGTERM/SIGINT; blocking."""
    configure_logging("sandbox")
    asyncio.run(serve(cfg, cfg.host, cfg.port))


def main(argv: list[str] | None = None) -> int:
    """`python -m services.reward_sandbox.server`: `marl serve sandbox` without the marl CLI."""
    parser = argparse.ArgumentParser(prog="python -m services.reward_sandbox.server")
    parser.add_argument("--config", default=None, help="YAML with marl.spec.services fields")
    add_flags(parser, "sandbox")
    args = parser.parse_args(argv)
    try:
        cfg = load_sandbox(args.config, **flag_values(args, "sandbox"))
        if cfg.trace_dir is not None:  # as `marl serve` does
            from marl.runtime import tracing

            tracing.configure("sandbox", cfg.trace_dir)
        run(cfg)
    except ValueError as e:
        print(f"error: {e}")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
