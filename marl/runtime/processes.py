"""What any marl process needs to know of other processes: a free loopback port to give a
server, a child that dies with its parent, and an exit status in words. Below the
services, so a service (the learner's rank processes) can use them without importing
the launcher."""

from __future__ import annotations

import os
import random
import signal
import socket
import sys
from pathlib import Path

_DIE_WITH_PARENT = """
import ctypes, os, signal, sys
try:
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG, kept across exec
except OSError:
    pass
if os.getppid() != int(sys.argv[1]):  # the launcher died before prctl
    sys.exit(1)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def die_with_parent(cmd: list[str]) -> list[str]:
    """`cmd`, run so that it gets SIGTERM when this process dies (Linux only).

    A small Python program sets the death signal, then execs `cmd`. This is not done in a
    `preexec_fn`: that makes subprocess fork() and run Python in the child before exec,
    and in a process whose gRPC threads are busy (a launcher watching its services)
    gRPC's fork handlers then abort the child ("epoll_wait error: Bad file descriptor").
    Without a preexec_fn the child is started with vfork, which runs no fork handlers.
    """
    return [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *cmd]


_LISTEN_PORTS = (20000, 32767)
"""Where `free_port` looks: below Linux's default ephemeral range (32768-60999)."""
_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A loopback port that is free now, for a server that will listen on it.

    Not one the kernel would pick itself (bind to port 0): those come from the
    ephemeral range, which every outgoing connection also draws its source port from,
    so between this call and the server's bind a Redis or gRPC client could take it
    (CI saw a learner fail to bind such a port). Ports are drawn at random outside
    that range and never twice in one process.
    """
    eph_low, eph_high = _ephemeral_range()
    low, high = _LISTEN_PORTS
    if low <= eph_high and eph_low <= high:  # an unusual ephemeral range: stay under it
        low, high = 1024, max(1025, eph_low - 1)
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randint(low, high)
        if port not in _handed_out and port_is_free(port):
            _handed_out.add(port)
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def how_it_ended(code: int | None) -> str:
    """A process's exit status in words: its code, or the signal that killed it."""
    if code is None or code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    how = f"was killed by {name}"
    if -code == signal.SIGKILL:
        how += " (the kernel's OOM killer does this when memory runs out: see dmesg)"
    return how
