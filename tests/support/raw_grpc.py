"""Any RPC of a service called by its name alone, as a client that has no stubs: what the
auth tests use to try every method of every service."""

from __future__ import annotations

from typing import Any

import grpc


def call_raw(channel: grpc.Channel, service: Any, method: Any,
             metadata: list[tuple[str, str]]) -> grpc.StatusCode:
    """Call `method` with an empty request, as a client that knows nothing but the name."""
    path = f"/{service.full_name}/{method.name}"
    try:
        if method.client_streaming:
            fn: Any = (channel.stream_stream if method.server_streaming else channel.stream_unary)
            reply = fn(path)(iter([b""]), timeout=10, metadata=metadata)
        else:
            fn = channel.unary_stream if method.server_streaming else channel.unary_unary
            reply = fn(path)(b"", timeout=10, metadata=metadata)
        if method.server_streaming:
            list(reply)
    except grpc.RpcError as err:
        return err.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK
