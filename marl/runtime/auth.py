"""Optional shared-secret authentication for every marl service, gRPC and HTTP.

With `$MARL_AUTH_TOKEN` (or `$MARL_AUTH_TOKEN_FILE`, see
`marl.spec.services.auth_token`) set, every gRPC server answers a call that
does not carry `authorization: Bearer <token>` metadata with UNAUTHENTICATED,
except the health and reflection services (probes and `grpcurl describe` need
no secret), and the HTTP front ends (OpenAI `/v1`, SandboxFusion `/run_code`)
answer 401 without an `Authorization: Bearer <token>` header; Prometheus
`/metrics` and the workflow's per-episode proxy (each episode reachable only
under its own random path token) stay open. Every marl client builds its
channel here, so the learner's pushes, the workers' calls, the CLI and the
launcher send the token whenever it is set in their environment.

What this does not protect: the token travels in clear text unless the
network is private or TLS is terminated in front of the services; anyone who
holds it may do anything any client may do.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
from aiohttp import web

from marl.spec.services import auth_token, tls_files

METADATA_KEY = "authorization"
EXEMPT_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
HTTP_OPEN_PATHS = ("/metrics",)
HTTP_OPEN_PREFIXES = ("/episodes/",)

ChannelOptions = Sequence[tuple[str, Any]] | None


def bearer(token: str) -> str:
    return f"Bearer {token}"


def _matches(presented: str | bytes | None, token: str) -> bool:
    if presented is None:
        return False
    if isinstance(presented, bytes):
        presented = presented.decode("latin-1")
    return hmac.compare_digest(presented.encode("latin-1", "replace"), bearer(token).encode())


# --- gRPC server ---------------------------------------------------------------------


def _deny(kind: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            "missing or wrong token: send `authorization: Bearer <token>` "
                            "metadata (set $MARL_AUTH_TOKEN for marl's clients)")

    if kind.request_streaming and kind.response_streaming:
        return grpc.stream_stream_rpc_method_handler(unary)
    if kind.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary)
    if kind.response_streaming:
        return grpc.unary_stream_rpc_method_handler(unary)
    return grpc.unary_unary_rpc_method_handler(unary)


class TokenAuth(grpc.aio.ServerInterceptor):
    """Refuses calls without the token (UNAUTHENTICATED); health and reflection are exempt."""

    def __init__(self, token: str):
        self.token = token

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = details.method or ""
        if method.startswith(EXEMPT_SERVICES):
            return await continuation(details)
        presented = dict(details.invocation_metadata or ()).get(METADATA_KEY)
        handler = await continuation(details)
        if _matches(presented, self.token) or handler is None:
            return handler  # an unknown method stays UNIMPLEMENTED
        return _deny(handler)


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    token = auth_token()
    return [TokenAuth(token)] if token else []


# --- gRPC clients --------------------------------------------------------------------


class _Metadata:
    def __init__(self, token: str):
        self.pair = (METADATA_KEY, bearer(token))

    def _details(self, details: Any) -> Any:
        metadata = [*(details.metadata or ()), self.pair]
        return details._replace(metadata=metadata)


class _SyncToken(_Metadata, grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, it: Any) -> Any:
        return continuation(self._details(details), it)

    def intercept_stream_stream(self, continuation: Any, details: Any, it: Any) -> Any:
        return continuation(self._details(details), it)


class _AioUnaryUnary(_Metadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioUnaryStream(_Metadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _AioStreamUnary(_Metadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, it: Any) -> Any:
        return await continuation(self._details(details), it)


class _AioStreamStream(_Metadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, it: Any) -> Any:
        return await continuation(self._details(details), it)


TLS_SERVER_NAME_ENV = "MARL_TLS_SERVER_NAME"


def _credentials() -> grpc.ChannelCredentials | None:
    ca = tls_files().get("ca")
    return None if ca is None else grpc.ssl_channel_credentials(root_certificates=ca)


def _tls_options(address: str, options: ChannelOptions) -> ChannelOptions:
    """With `$MARL_TLS_SERVER_NAME` set, a server dialled at an IP address must present a
    certificate for that name instead of the address: inference replicas advertise their
    pod IPs, which no long-lived certificate can list (the Helm chart sets it). A server
    dialled by name is still checked against that name."""
    name = os.environ.get(TLS_SERVER_NAME_ENV)
    if not name:
        return options
    try:
        ipaddress.ip_address(address.rsplit(":", 1)[0].strip("[]"))
    except ValueError:
        return options
    return [*(options or []), ("grpc.ssl_target_name_override", name)]


def channel(address: str, options: ChannelOptions = None) -> grpc.Channel:
    """A blocking channel to `address` that sends the token when one is set, over TLS
    (verified against `$MARL_TLS_CA`, see `_tls_options`) when that is set."""
    creds = _credentials()
    if creds is not None:
        options = _tls_options(address, options)
    ch = (grpc.insecure_channel(address, options=options) if creds is None
          else grpc.secure_channel(address, creds, options=options))
    token = auth_token()
    return grpc.intercept_channel(ch, _SyncToken(token)) if token else ch


def aio_channel(address: str, options: ChannelOptions = None) -> grpc.aio.Channel:
    """An asyncio channel to `address` that sends the token when one is set."""
    token = auth_token()
    interceptors: list[grpc.aio.ClientInterceptor] = (
        [_AioUnaryUnary(token), _AioUnaryStream(token), _AioStreamUnary(token),
         _AioStreamStream(token)] if token else [])
    creds = _credentials()
    if creds is not None:
        return grpc.aio.secure_channel(address, creds, options=_tls_options(address, options),
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


# --- HTTP ----------------------------------------------------------------------------


def http_middleware(token: str) -> Any:
    """aiohttp middleware: 401 without `Authorization: Bearer <token>` on protected paths."""

    @web.middleware
    async def require_token(request: web.Request, handler: Any) -> web.StreamResponse:
        path = request.path
        if path in HTTP_OPEN_PATHS or path.startswith(HTTP_OPEN_PREFIXES):
            return await handler(request)
        if not _matches(request.headers.get("Authorization"), token):
            return web.json_response(
                {"error": {"message": "missing or wrong token: send `Authorization: Bearer "
                                      "<token>`", "type": "authentication_error",
                           "code": "unauthenticated"}},
                status=401, headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return require_token


def http_headers() -> dict[str, str]:
    """Headers a marl HTTP client adds: the bearer token when one is set."""
    token = auth_token()
    return {"Authorization": bearer(token)} if token else {}
