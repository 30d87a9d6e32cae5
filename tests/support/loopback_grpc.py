"""A servicer served by a real grpc.aio server on a free loopback port, for unit tests of
the clients that call it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc


@asynccontextmanager
async def serving(
    servicer: Any, add_to_server: Callable[[Any, grpc.aio.Server], None]
) -> AsyncIterator[str]:
    """`add_to_server` is the generated `add_<Service>Servicer_to_server`; yields the
    server's address."""
    server = grpc.aio.server()
    add_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)
