"""One HTTP server per service process, on its own port, in the service's event loop.

gRPC stays the internal protocol; HTTP is for the ecosystem's protocols (the
sandbox's SandboxFusion `POST /run_code`, inference's OpenAI `/v1/...`) and for
any later route such as Prometheus `/metrics`: each adds its routes to the same
`aiohttp` application before `start()`, so a service has one HTTP port whatever
it serves. Handlers run in the asyncio loop the gRPC server runs in, so they
call the same service objects (the sandbox's admission and jails, the inference
engine and its batches) as the gRPC handlers, without a thread or a copy.
"""

from __future__ import annotations

import json
import logging
import os
import ssl
from typing import Any

from aiohttp import web

from marl.runtime import auth, prometheus_metrics
from marl.spec import safe_input
from marl.spec.services import TLS_CERT_ENV, TLS_KEY_ENV, tls_files

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 64 << 20


class HttpServer:
    """An aiohttp application bound to `host:port` (0 picks a free port) once started.
    `users`: with authentication on, users' tokens may call its routes (inference's
    OpenAI API); otherwise only the services' token may (`marl.runtime.auth`). `books`:
    the tokens it accepts (the sandbox's own for the sandbox)."""

    def __init__(self, host: str, port: int, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 users: bool = False, books: auth.BookSource = auth.token_book):
        book = books()
        middlewares = [auth.http_middleware(book, users)] if book else []
        self.app = web.Application(client_max_size=max_body_bytes, middlewares=middlewares)
        prometheus_metrics.mount(self.app)  # every service's HTTP port serves Prometheus /metrics
        self.host = host
        self.requested_port = port
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        """Bind and serve; a port that cannot be bound is a ValueError naming --http-port."""
        # A client that goes away cancels its handler, as a cancelled gRPC call does:
        # a sandbox job is killed, a generation request leaves its batch.
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False,
                                     handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.requested_port, reuse_port=False,
                           ssl_context=_server_ssl())
        try:
            await site.start()
        except OSError as err:
            await self._runner.cleanup()
            self._runner = None
            raise ValueError(
                f"--http-port: cannot bind {self.host}:{self.requested_port} ({err.strerror}); "
                "choose a free port"
            ) from None
        self.port = int(self._runner.addresses[0][1])
        log.info("HTTP listening on %s", self.address)
        print(f"http listening on {self.address}", flush=True)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


def _server_ssl() -> ssl.SSLContext | None:
    """TLS for the HTTP port when `$MARL_TLS_CERT`/`$MARL_TLS_KEY` are set (as for gRPC)."""
    if "cert" not in tls_files():
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(os.environ[TLS_CERT_ENV], os.environ[TLS_KEY_ENV])
    return ctx


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None
                  ) -> web.Response:
    return web.Response(text=json.dumps(body), status=status, headers=headers,
                        content_type="application/json")


MAX_BODY_DEPTH = 128
"""Lists/objects a JSON request body may nest; deeper ones (a hostile `[[[[...`) are refused
by name rather than left to exhaust the parser's recursion."""


async def read_json_object(request: web.Request) -> dict[str, Any]:
    """The request body as a JSON object; a ValueError saying why it is not one."""
    too_deep_error = (f"body: nested more than {MAX_BODY_DEPTH} lists/objects deep "
                      f"(the limit is {MAX_BODY_DEPTH})")
    try:
        body = await request.json(loads=json.loads)
    except RecursionError:
        raise ValueError(too_deep_error) from None
    except ValueError as err:
        raise ValueError(f"body: not valid JSON ({err})") from None
    if safe_input.too_deep(body, MAX_BODY_DEPTH):
        raise ValueError(too_deep_error)
    if not isinstance(body, dict):
        raise ValueError("body: must be a JSON object")
    return body
