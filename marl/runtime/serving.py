"""What every marl gRPC server shares: grpc.aio, health, reflection, SIGTERM.

A server starts NOT_SERVING, the service flips it to SERVING once its model or
adapters are ready, and on SIGTERM/SIGINT it reports NOT_SERVING again and stops
with a grace period so in-flight calls finish. SIGUSR1 writes every thread's stack
to stderr (from C, so it works while the event loop is stuck) and SIGUSR2 logs every
asyncio task's stack: `kill -USR1 PID` shows where a hung service waits.

A service process (`serve_until_stopped`) exits within its drain time plus 10 s of
SIGTERM/SIGINT, or of its parent's death, whether Redis answers or not: `StopWatchdog`
ends a process whose cleanup outlives `drain_s + STOP_MARGIN_S` (cleanup blocks on a
Redis that is gone: its client retries each command for ~30 s), and when the launcher
started it (`PARENT_PID_ENV`), stops it once its parent is gone.
"""

from __future__ import annotations

import asyncio
import faulthandler
import inspect
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from marl.runtime import auth
from marl.runtime.aio_tasks import cancel_until_done, log_task_stacks
from marl.runtime.gc_pauses import freeze_long_lived
from marl.runtime.prometheus_metrics import GrpcMetrics
from marl.spec.services import tls_files

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]


MAX_DETAILS_BYTES = 1536
"""An error message's UTF-8 size limit: the status travels as percent-encoded trailing
metadata (up to 3 bytes per byte), and a client refuses metadata over 8 KiB, turning the
error into "Stream removed". Longer messages (ones echoing a caller's huge input) are cut."""


def bounded(details: str | None, limit: int = MAX_DETAILS_BYTES) -> str | None:
    """`details` cut to `limit` UTF-8 bytes, saying how much was left out."""
    if details is None:
        return None
    raw = details.encode("utf-8", "replace")
    if len(raw) <= limit:
        return details
    keep = raw[: limit - 40].decode("utf-8", "ignore")
    return f"{keep}... [{len(raw) - len(keep.encode())} more bytes cut]"


class _BoundedContext:
    """A ServicerContext whose error messages are bounded (everything else passes through)."""

    def __init__(self, context: grpc.aio.ServicerContext):
        self._context = context

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()
    ) -> None:
        await self._context.abort(code, bounded(details) or "", trailing_metadata)

    def set_details(self, details: str) -> None:
        self._context.set_details(bounded(details) or "")


def unexpected_details(err: Exception) -> str:
    """The UNKNOWN status message of an exception a handler did not expect, bounded."""
    return bounded(f"Unexpected {type(err).__name__}: {err}") or ""


async def _unexpected(err: Exception, context: grpc.aio.ServicerContext) -> None:
    """What grpc.aio does with an exception a handler lets out (log it, answer UNKNOWN),
    with the message bounded; an abort passes through as it is."""
    if isinstance(err, grpc.aio.AbortError):
        raise err
    log.error("unexpected error in a handler", exc_info=err)
    await context.abort(grpc.StatusCode.UNKNOWN, unexpected_details(err))


def _bounded_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    kinds = [
        ("unary_unary", grpc.unary_unary_rpc_method_handler),
        ("unary_stream", grpc.unary_stream_rpc_method_handler),
        ("stream_unary", grpc.stream_unary_rpc_method_handler),
        ("stream_stream", grpc.stream_stream_rpc_method_handler),
    ]
    for attr, make in kinds:
        fn = getattr(handler, attr)
        if fn is None:
            continue
        if inspect.isasyncgenfunction(fn):

            async def gen(request: Any, context: Any, fn: Any = fn) -> Any:
                try:
                    async for item in fn(request, _BoundedContext(context)):
                        yield item
                except Exception as err:
                    await _unexpected(err, context)

            wrapped: Any = gen
        else:

            async def call(request: Any, context: Any, fn: Any = fn) -> Any:
                try:
                    return await fn(request, _BoundedContext(context))
                except Exception as err:
                    await _unexpected(err, context)

            wrapped = call
        return make(
            wrapped,
            request_deserializer=handler.request_deserializer,  # type: ignore[operator]
            response_serializer=handler.response_serializer,
        )
    return handler


class BoundedErrors(grpc.aio.ServerInterceptor):
    """Every handler's error messages are cut to MAX_DETAILS_BYTES (see `bounded`)."""

    async def intercept_service(
        self, continuation: Any, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        return handler if handler is None else _bounded_handler(handler)


STOP_MARGIN_S = 8.0
"""A stopping service gets its drain time plus this to exit by itself (in-flight calls'
grace, 5 s, and cleanup); past it `StopWatchdog` ends the process, so that with the
interpreter's own exit it is gone within drain + 10 s."""
PARENT_PID_ENV = "MARL_PARENT_PID"
"""Set by the launcher (marl/local/launcher.py) to its pid: a service whose parent is no longer
that process (the launcher was killed, even with SIGKILL) stops as on SIGTERM."""
POLL_S = 0.1
"""How often the watchdog looks at the clock and the parent's pid."""


class StopWatchdog:
    """A daemon thread that ends a stopping process which does not end by itself, and stops
    an orphaned one. It polls plain attributes (no locks), so `arm` is safe to call from a
    signal handler, whatever the main thread was doing."""

    def __init__(self, budget_s: float, parent_pid: int | None = None):
        self.budget_s = budget_s
        """Seconds from `arm` to the forced exit."""
        self.parent_pid = parent_pid
        self.armed_at: float | None = None
        self.why = ""
        self.on_orphaned: Callable[[], None] | None = None
        """Called (on the watchdog's thread) once the parent is gone."""

    @classmethod
    def from_env(cls, budget_s: float) -> StopWatchdog:
        raw = os.environ.get(PARENT_PID_ENV, "")
        return cls(budget_s, int(raw) if raw.isdigit() else None)

    def start(self) -> None:
        threading.Thread(target=self._run, name="stop-watchdog", daemon=True).start()

    def arm(self, why: str) -> None:
        if self.armed_at is None:
            self.why = why
            self.armed_at = time.monotonic()

    def _run(self) -> None:
        while self.armed_at is None:
            time.sleep(POLL_S)
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                self.arm(f"its parent (pid {self.parent_pid}) is gone")
                if self.on_orphaned is not None:
                    self.on_orphaned()
        deadline = self.armed_at + self.budget_s
        while time.monotonic() < deadline:
            time.sleep(POLL_S)
        # os.write, not logging: the main thread may hold the logging lock forever
        os.write(
            2,
            f"stop-watchdog: still running {self.budget_s:.0f}s after a stop "
            f"({self.why}); exiting now\n".encode(),
        )
        os._exit(1)


class ServiceHost:
    """One grpc.aio server with health and reflection for a set of services."""

    def __init__(self, service_names: Iterable[str], host: str, port: int,
                 books: auth.BookSource = auth.token_book):
        """`books`: the tokens it accepts (the services' and users'; the sandbox's own)."""
        interceptors = [*auth.server_interceptors(books), GrpcMetrics(), BoundedErrors()]
        self.server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server
        )
        tls = tls_files()
        if "cert" in tls:  # TLS only: no plaintext port beside it
            creds = grpc.ssl_server_credentials([(tls["key"], tls["cert"])])
            self.port = self.server.add_secure_port(f"{host}:{port}", creds)
        else:
            self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise ValueError(f"--port: cannot bind {host}:{port}; choose a free port")
        self.address = f"{host}:{self.port}"
        self._stop = asyncio.Event()
        self.watchdog: StopWatchdog | None = None
        """Set by `serve_until_stopped`: armed as soon as a stop is asked."""

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def start(self) -> None:
        await self.set_serving(False)
        await self.server.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
        loop.add_signal_handler(signal.SIGUSR2, log_task_stacks)

    def request_stop(self) -> None:
        self._stop.set()

    @property
    def stopping(self) -> bool:
        """A stop was requested (SIGTERM, SIGINT or `request_stop`)."""
        return self._stop.is_set()

    @property
    def stop_event(self) -> asyncio.Event:
        """Set once a stop is requested: for work that ends itself early on a stop (a
        learner's run checkpointing the step it is on)."""
        return self._stop

    async def wait_for_stop(self, grace: float = 5.0) -> None:
        await self._stop.wait()
        if self.watchdog is not None:
            self.watchdog.arm("stop requested")
        log.info("stopping %s", self.address)
        await self.set_serving(False)
        await self.server.stop(grace)


async def serve_until_stopped(
    host: ServiceHost,
    ready: Callable[[], Awaitable[None]] | None = None,
    background: list[Callable[[], Coroutine[Any, Any, None]]] | None = None,
    on_stop: Callable[[], Awaitable[None]] | None = None,
    grace: float = 5.0,
    drain_s: float = 0.0,
) -> None:
    """Start, run `ready`, freeze what start-up built out of later garbage collections
    (`marl.runtime.gc_pauses`) and report SERVING, run background loops, stop on signal: in-flight
    calls get `grace` seconds, background loops that end by themselves once `host.stopping`
    (a worker finishing its episodes) get `drain_s` in all, then the rest are cancelled.
    The process exits within `drain_s + STOP_MARGIN_S` of the stop (`StopWatchdog`)."""
    await host.start()
    _watch_for_stop(host, drain_s + STOP_MARGIN_S)
    print(f"listening on {host.address}", flush=True)
    if ready is not None:
        await ready()
    freeze_long_lived()  # what start-up loaded lives as long as the process
    if not host.stopping:
        await host.set_serving(True)
    tasks: list[asyncio.Task[None]] = [asyncio.create_task(fn()) for fn in background or []]
    for t in tasks:
        t.add_done_callback(_stop_on_crash(host))
    try:
        await host.wait_for_stop(grace)
        if drain_s > 0 and tasks:
            await asyncio.wait(tasks, timeout=drain_s)
    finally:
        await cancel_until_done(tasks)
        if on_stop is not None:
            await on_stop()


def _watch_for_stop(host: ServiceHost, budget_s: float) -> None:
    """Arm a `StopWatchdog` on SIGTERM/SIGINT from the signal handler itself (the event
    loop, which also hears the signal, may be busy), and on the parent's death."""
    loop = asyncio.get_running_loop()
    watchdog = host.watchdog = StopWatchdog.from_env(budget_s)

    def stop() -> None:
        try:
            loop.call_soon_threadsafe(host.request_stop)
        except RuntimeError:  # the loop is closed: the process is exiting anyway
            pass

    watchdog.on_orphaned = stop

    def on_signal(signum: int, frame: Any) -> None:
        watchdog.arm(signal.Signals(signum).name)
        stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    watchdog.start()


def _stop_on_crash(host: ServiceHost) -> Callable[[asyncio.Task[None]], None]:
    def callback(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("background loop crashed", exc_info=task.exception())
            host.request_stop()

    return callback


async def wait_healthy(address: str, timeout: float = 120.0, service: str = "") -> None:
    """Block until `address` reports SERVING, or raise TimeoutError."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    # health needs no token: none is sent (the sandbox must never see the services')
    async with auth.aio_channel(address, token_from=auth.no_token) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                resp = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            if loop.time() > deadline:
                raise TimeoutError(f"{address} did not report SERVING within {timeout:.0f}s")
            await asyncio.sleep(0.2)


def configure_logging(name: str) -> None:
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s"
    )
