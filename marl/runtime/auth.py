"""Authentication, and who may call what, for every marl service, gRPC and HTTP.

With `$MARL_AUTH_TOKEN` (or `$MARL_AUTH_TOKEN_FILE`, see
`marl.spec.services.auth_token`) set, every gRPC server answers a call that does
not carry `authorization: Bearer <token>` metadata with a known token with
UNAUTHENTICATED, except the health and reflection services (probes and `grpcurl
describe` need no secret), and the HTTP front ends (OpenAI `/v1`, SandboxFusion
`/run_code`) answer 401 without such an `Authorization` header; Prometheus
`/metrics` and the workflow's per-episode proxy (each episode reachable only under
its own random path token) stay open. Every marl client builds its channel here,
so the learner's pushes, the workers' calls, the CLI and the launcher send the
token of their environment whenever one is set.

The reward sandbox is the exception: it holds and accepts only a token of its own
(`$MARL_SANDBOX_TOKEN`, `sandbox_token_book`), which its clients send (`token_from`
of `channel`), and refuses to start holding the services' token: code that escapes
one of its jobs finds no token that directs another service.

A known token is the services' own (`$MARL_AUTH_TOKEN` on a service: the service
identity, which may call anything) or a user's, from the token file
`$MARL_AUTH_TOKENS_FILE` names (`marl.spec.users`, read again when it changes). A
user may call the user-facing RPCs (`USER_METHODS`: the Runs API, generation,
inference's adapter list and info) and the HTTP front ends built with `users=True`
(inference's OpenAI API); every other RPC (adapter pushes and unloads, episodes,
the sandbox) is the services' own and answers a user PERMISSION_DENIED (HTTP 403).
A handler learns who called it from `caller()`; what a user may see of runs and
adapters (its own) the learner and inference decide with it.

What this does not protect: tokens travel in clear text unless TLS is on or the
network is private; whoever holds the services' token (any marl pod, the operator)
may do anything; a user's token is as good as the user until it leaves the file.
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import ipaddress
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from contextvars import ContextVar
from typing import Any

import grpc
from aiohttp import web

from marl.spec.services import auth_token, auth_users_file, sandbox_token, tls_files
from marl.spec.users import OPEN, SERVICE, Identity, read_token_file

log = logging.getLogger(__name__)

METADATA_KEY = "authorization"
EXEMPT_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
HTTP_OPEN_PATHS = ("/metrics",)
HTTP_OPEN_PREFIXES = ("/episodes/",)
USER_METHODS = frozenset({
    "/marl.v1.Learner/SubmitRun",
    "/marl.v1.Learner/GetRun",
    "/marl.v1.Learner/ListRuns",
    "/marl.v1.Learner/CancelRun",
    "/marl.v1.Learner/WatchRun",
    "/marl.v1.Inference/Generate",
    "/marl.v1.Inference/GenerateMany",
    "/marl.v1.Inference/ListAdapters",
    "/marl.v1.Inference/GetInfo",
})
"""The RPCs a user's token may call; every other one is the services' own (a new RPC is
too until it is listed here)."""

ChannelOptions = Sequence[tuple[str, Any]] | None

_CALLER: ContextVar[Identity] = ContextVar("marl_caller", default=OPEN)


def caller() -> Identity:
    """Who made the call being handled: the service identity, a user, or `OPEN` (anyone,
    while authentication is off)."""
    return _CALLER.get()


def owner_filter() -> str | None:
    """The one owner whose runs and adapters the call being handled may see, or None (all
    of them) for admins, the services, and anyone while authentication is off."""
    who = caller()
    return None if who.admin else who.user


def bearer(token: str) -> str:
    return f"Bearer {token}"


def _raw(value: str | bytes) -> bytes:
    # surrogatepass: a lone surrogate becomes bytes no valid token's UTF-8 can equal
    return value if isinstance(value, bytes) else value.encode("utf-8", "surrogatepass")


class TokenBook:
    """Who a presented `Bearer <token>` is: the service identity, a user of the token file,
    or nobody (None). Compared in constant time: the service token with
    `hmac.compare_digest`; a user's found by the SHA-256 of what was presented (what the
    lookup's timing depends on, which tells nothing of any token) and compared again.

    The file is read again when its modification time, size or inode changes (a
    Kubernetes Secret's update swaps the file). A version that cannot be read or parsed
    lets no user in until it is fixed (logged); the service identity is not affected.
    """

    def __init__(self, service_token: str, users_file: str | None):
        self._service = _raw(bearer(service_token))
        self.users_file = users_file
        self._stamp: tuple[int, int, int] | None = None
        self._users: dict[bytes, tuple[bytes, Identity]] = {}

    def identify(self, presented: str | bytes | None) -> Identity | None:
        if presented is None:
            return None
        raw = _raw(presented)
        if hmac.compare_digest(raw, self._service):
            return SERVICE
        found = self._current_users().get(hashlib.sha256(raw).digest())
        if found is None or not hmac.compare_digest(raw, found[0]):
            return None
        return found[1]

    def _current_users(self) -> dict[bytes, tuple[bytes, Identity]]:
        if self.users_file is None:
            return {}
        try:
            st = os.stat(self.users_file)
            stamp: tuple[int, int, int] | None = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            stamp = None
        if stamp is not None and stamp == self._stamp:
            return self._users
        self._stamp = stamp
        try:
            users = read_token_file(self.users_file)
        except ValueError as err:
            log.error("%s; no user token is accepted until it is fixed", err)
            users = {}
        book = {}
        for token, who in users.items():
            raw = _raw(bearer(token))
            if hmac.compare_digest(raw, self._service):
                log.error("user %r has the services' token; it is not accepted as a user",
                          who.user[:60])
                continue
            book[hashlib.sha256(raw).digest()] = (raw, who)
        self._users = book
        return book


def token_book() -> TokenBook | None:
    """The book of this process's environment, or None while authentication is off."""
    token = auth_token()
    return None if token is None else TokenBook(token, auth_users_file())


def sandbox_token_book() -> TokenBook | None:
    """The reward sandbox's book: its own token (`$MARL_SANDBOX_TOKEN`) as the one service
    identity, no users, or None while the sandbox's authentication is off. The services'
    token is not in it: the sandbox answers that one UNAUTHENTICATED."""
    token = sandbox_token()
    return None if token is None else TokenBook(token, None)


BookSource = Callable[[], TokenBook | None]
TokenSource = Callable[[], str | None]


def no_token() -> None:
    """The token source of a channel that sends none (health checks, which need none)."""
    return None


# --- gRPC server ---------------------------------------------------------------------

UNAUTHENTICATED_DETAILS = ("missing or unknown token: send `authorization: Bearer <token>` "
                           "metadata (set $MARL_AUTH_TOKEN for marl's clients)")


def _refuse(kind: grpc.RpcMethodHandler, code: grpc.StatusCode,
            details: str) -> grpc.RpcMethodHandler:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, details)

    if kind.request_streaming and kind.response_streaming:
        return grpc.stream_stream_rpc_method_handler(unary)
    if kind.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary)
    if kind.response_streaming:
        return grpc.unary_stream_rpc_method_handler(unary)
    return grpc.unary_unary_rpc_method_handler(unary)


def _as_caller(handler: grpc.RpcMethodHandler, who: Identity) -> grpc.RpcMethodHandler:
    """The handler, run with `caller()` answering `who`."""
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
                _CALLER.set(who)  # in the call's own task: no other call sees it
                async for item in fn(request, context):
                    yield item

            wrapped: Any = gen
        else:

            async def call(request: Any, context: Any, fn: Any = fn) -> Any:
                _CALLER.set(who)
                return await fn(request, context)

            wrapped = call
        return make(
            wrapped,
            request_deserializer=handler.request_deserializer,  # type: ignore[operator]
            response_serializer=handler.response_serializer,
        )
    return handler


class TokenAuth(grpc.aio.ServerInterceptor):
    """Refuses calls without a known token (UNAUTHENTICATED) and users' calls of the
    services' own RPCs (PERMISSION_DENIED); health and reflection are exempt. The
    handler of an admitted call sees its caller through `caller()`."""

    def __init__(self, book: TokenBook):
        self.book = book

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = details.method or ""
        handler = await continuation(details)
        if handler is None or method.startswith(EXEMPT_SERVICES):
            return handler  # an unknown method stays UNIMPLEMENTED
        who = self.book.identify(dict(details.invocation_metadata or ()).get(METADATA_KEY))
        if who is None:
            return _refuse(handler, grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_DETAILS)
        if not who.service and method not in USER_METHODS:
            return _refuse(handler, grpc.StatusCode.PERMISSION_DENIED,
                           f"{method} is for marl's own services: a user's token may not "
                           "call it")
        return _as_caller(handler, who)


def server_interceptors(books: BookSource = token_book) -> list[grpc.aio.ServerInterceptor]:
    book = books()
    return [TokenAuth(book)] if book else []


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


def channel(address: str, options: ChannelOptions = None,
            token_from: TokenSource = auth_token) -> grpc.Channel:
    """A blocking channel to `address` that sends the token when one is set, over TLS
    (verified against `$MARL_TLS_CA`, see `_tls_options`) when that is set. `token_from`:
    where the token comes from (the services' by default; the sandbox's clients pass
    `sandbox_token`: the sandbox must never see the services' token)."""
    creds = _credentials()
    if creds is not None:
        options = _tls_options(address, options)
    ch = (grpc.insecure_channel(address, options=options) if creds is None
          else grpc.secure_channel(address, creds, options=options))
    token = token_from()
    return grpc.intercept_channel(ch, _SyncToken(token)) if token else ch


def aio_channel(address: str, options: ChannelOptions = None,
                token_from: TokenSource = auth_token) -> grpc.aio.Channel:
    """An asyncio channel to `address` that sends the token when one is set (as `channel`)."""
    token = token_from()
    interceptors: list[grpc.aio.ClientInterceptor] = (
        [_AioUnaryUnary(token), _AioUnaryStream(token), _AioStreamUnary(token),
         _AioStreamStream(token)] if token else [])
    creds = _credentials()
    if creds is not None:
        return grpc.aio.secure_channel(address, creds, options=_tls_options(address, options),
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


# --- HTTP ----------------------------------------------------------------------------


def http_middleware(book: TokenBook, users: bool) -> Any:
    """aiohttp middleware: 401 without a known `Authorization: Bearer <token>` on protected
    paths; 403 for a user's token unless `users` (a front end users may call). The
    handler sees its caller through `caller()`."""

    @web.middleware
    async def require_token(request: web.Request, handler: Any) -> web.StreamResponse:
        path = request.path
        if path in HTTP_OPEN_PATHS or path.startswith(HTTP_OPEN_PREFIXES):
            return await handler(request)
        who = book.identify(request.headers.get("Authorization"))
        if who is None:
            return web.json_response(
                {"error": {"message": "missing or unknown token: send `Authorization: Bearer "
                                      "<token>`", "type": "authentication_error",
                           "code": "unauthenticated"}},
                status=401, headers={"WWW-Authenticate": "Bearer"})
        if not who.service and not users:
            return web.json_response(
                {"error": {"message": f"{path[:200]} is for marl's own services: a user's "
                                      "token may not call it", "type": "permission_error",
                           "code": "permission_denied"}},
                status=403)
        reset = _CALLER.set(who)
        try:
            return await handler(request)
        finally:
            _CALLER.reset(reset)

    return require_token

