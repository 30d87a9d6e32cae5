"""What a gRPC status from one of marl's services says about the service, for callers
deciding whether to send a call elsewhere or again."""

from __future__ import annotations

import grpc

SERVER_GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
"""The server is down, restarting or stopping, so the call may go to another replica or be
sent again. A stopping grpc.aio server answers UNAVAILABLE, or CANCELLED to a call that
reached it before any handler took it (grpc/grpc#41785). A caller's own cancellation
raises asyncio.CancelledError in the caller and is not retried by gRPC, so it is never
mistaken for one of these."""

NO_ANSWER = (*SERVER_GONE, grpc.StatusCode.DEADLINE_EXCEEDED)
"""The server did not answer: gone, or not within the call's deadline."""
