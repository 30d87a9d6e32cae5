"""The server's side of the zygote: starts it and asks it for jails.

The zygote (`forkserver`) is a single-threaded fork server that starts every
job's jail. The gRPC server is multi-threaded and must not fork, and a fresh
interpreter per job would pay Python's start-up every time. So the server
starts one zygote (`python -I -S -X utf8`, empty environment) that imports the
jail code and the common standard-library modules once, detects the isolation
tier, and then forks one jail per job. The zygote never sees job content: it
only passes the job's descriptors on. It is a child subreaper, so anything a
job leaves behind is re-parented to it and reaped, and it dies with the
server.

`ZygoteClient` is the server's asyncio side of the control socket; it lives
here, apart from `forkserver`, so the zygote never imports asyncio.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
from typing import Any

from . import wire
from .forkserver import ROOT

MARKER = "marl-sandbox-zygote"
_BOOT = (
    "import sys; sys.path.insert(0, {root!r}); "
    "from services.reward_sandbox import forkserver; forkserver.main()"
)


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_spawned(fut: asyncio.Future[int]) -> None:
    if not fut.cancelled() and fut.exception() is None:
        _killpg(fut.result())


class ZygoteError(RuntimeError):
    pass


class ZygoteClient:
    """Starts the zygote and asks it for jails; restarts it if it dies."""

    def __init__(self, config: dict[str, Any]):
        self.config = config
        self.proc: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None
        self.report: dict[str, Any] = {}
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future[int]] = {}
        self._ready: asyncio.Future[dict[str, Any]] | None = None
        self._lock = asyncio.Lock()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    async def start(self) -> dict[str, Any]:
        async with self._lock:
            if self.sock is None:
                await self._launch()
        return self.report

    async def _launch(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ) if self.config["sabotage"] else {}
        argv = [sys.executable, "-I", "-S", "-X", "utf8", "-c", _BOOT.format(root=ROOT),
                str(theirs.fileno()), str(os.getpid()), json.dumps(self.config), MARKER]
        self.proc = subprocess.Popen(argv, pass_fds=[theirs.fileno()], env=env,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     cwd="/")
        theirs.close()
        mine.setblocking(False)
        self.sock = mine
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        loop.add_reader(mine.fileno(), self._on_readable)
        self.report = await asyncio.wait_for(self._ready, timeout=60)

    def _on_readable(self) -> None:
        assert self.sock is not None
        try:
            got = wire.recv_msg(self.sock)
        except BlockingIOError:
            return
        except OSError:
            got = None
        if got is None:
            self._died()
            return
        msg, _ = got
        if "ready" in msg and self._ready is not None and not self._ready.done():
            self._ready.set_result(msg["ready"])
            return
        fut = self._pending.pop(msg["id"], None)
        if fut is not None and not fut.done():
            fut.set_result(int(msg["pid"]))

    def _died(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            asyncio.get_running_loop().remove_reader(sock.fileno())
            sock.close()
        error = ZygoteError("the sandbox zygote exited")
        for fut in [*self._pending.values(), self._ready]:
            if fut is not None and not fut.done():
                fut.set_exception(error)
        self._pending.clear()
        if self.proc is not None:
            self.proc.wait()

    async def spawn(self, spec: dict[str, Any], fds: list[int]) -> int:
        """Fork a jail for one job; returns its pid (also its process group)."""
        if self.sock is None:
            await self.start()
        assert self.sock is not None
        job_id = next(self._ids)
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._pending[job_id] = fut
        while True:
            try:
                wire.send_msg(self.sock, {"id": job_id, "spec": spec}, fds)
                break
            except BlockingIOError:
                await asyncio.sleep(0.001)
        try:
            # Not asyncio.wait_for: on Python 3.11 it returns the result instead of
            # raising when the caller is cancelled just as the pid arrives, so a
            # cancelled call would go on running its job to the time limit.
            async with asyncio.timeout(30):
                return await asyncio.shield(fut)
        except BaseException:
            # The caller gave up before it got the pid: kill the jail once the pid is
            # known (at once if it already is), or it runs on with no one reading it.
            fut.add_done_callback(_kill_spawned)
            raise

    def close(self) -> None:
        if self.sock is not None:
            asyncio.get_running_loop().remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None
        if self.proc is not None:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def single_threaded_probe(config: dict[str, Any]) -> dict[str, Any]:
    """Tier detection for `doctor`: runs in the calling process, which must not have threads."""
    from . import namespaces, tiers

    spec = {"root": namespaces.plan_root(config["tmp_bytes"], config["tmp_inodes"]).to_json(),
            "max_processes": config["max_processes"],
            "max_memory_bytes": config["max_memory_bytes"], "max_jobs": config["max_jobs"]}
    return tiers.detect(spec, config["isolation"])
