"""Message framing between the sandbox's processes.

Seqpacket sockets carry one JSON message per packet, with file descriptors
attached (server <-> zygote, harness <-> template). Pipes and stream sockets
carry length-prefixed JSON frames (candidate <-> harness, harness -> server).
A frame reader never trusts the length it is told: frames over `cap` bytes,
malformed JSON and a silent peer past the deadline are errors.
"""

from __future__ import annotations

import json
import os
import select
import socket
import struct
import time
from typing import Any

_HEADER = struct.Struct(">I")


class FrameError(Exception):
    """The peer sent something that is not a frame, or a frame over the size cap."""


def encode_frame(obj: Any) -> bytes:
    data = json.dumps(obj, separators=(",", ":")).encode()
    return _HEADER.pack(len(data)) + data


def write_frame(fd: int, obj: Any) -> None:
    view = memoryview(encode_frame(obj))
    while view:
        view = view[os.write(fd, view):]


def send_msg(sock: socket.socket, obj: Any, fds: list[int] | tuple[int, ...] = ()) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def recv_msg(sock: socket.socket, maxfds: int = 8) -> tuple[Any, list[int]] | None:
    """One message and its descriptors, or None at end of stream."""
    data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 20, maxfds)
    if not data:
        for fd in fds:
            os.close(fd)
        return None
    return json.loads(data), fds


def read_json_fd(fd: int) -> Any:
    """Parse a whole memfd as JSON by offset (it may be shared) and close it."""
    chunks = []
    offset = 0
    try:
        while chunk := os.pread(fd, 1 << 20, offset):
            chunks.append(chunk)
            offset += len(chunk)
    finally:
        os.close(fd)
    return json.loads(b"".join(chunks))


class Nonces:
    """The executor's nonces memfd: a fixed-width hex nonce per test, then the done
    record's. Each is read from the descriptor only when its record is written."""

    WIDTH = 32

    def __init__(self, fd: int):
        self.fd = fd

    def read(self, index: int) -> str:
        return os.pread(self.fd, self.WIDTH, index * self.WIDTH).decode("ascii")


class FrameReader:
    """Reads frames from a blocking descriptor with a deadline and a size cap."""

    def __init__(self, fd: int, cap: int):
        self.fd = fd
        self.cap = cap
        self.buf = bytearray()

    def read(self, deadline: float | None) -> Any:
        """The next frame; EOFError at end of stream, TimeoutError past `deadline`."""
        while True:
            if len(self.buf) >= _HEADER.size:
                (size,) = _HEADER.unpack_from(self.buf)
                if size > self.cap:
                    raise FrameError(f"frame of {size} bytes is over the {self.cap} byte cap")
                if len(self.buf) >= _HEADER.size + size:
                    data = bytes(self.buf[_HEADER.size:_HEADER.size + size])
                    del self.buf[:_HEADER.size + size]
                    try:
                        return json.loads(data)
                    except (ValueError, RecursionError) as e:
                        raise FrameError(f"malformed frame: {type(e).__name__}") from None
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self.fd], [], [], wait)
            if not ready:
                raise TimeoutError
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                raise EOFError
            self.buf += chunk
