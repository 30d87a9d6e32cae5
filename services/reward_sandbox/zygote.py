"""The zygote: a single-threaded fork server that starts every job's jail.

The gRPC server is multi-threaded and must not fork, and a fresh interpreter
per job would cost ~10 ms of start-up. So the server starts one zygote
(`python -I -S -X utf8`, empty environment) that imports the jail code and the
common standard-library modules once, detects the isolation tier, and then
forks one jail per job. The zygote never sees job content: it only passes the
job's descriptors on. It is a child subreaper, so anything a job leaves
behind is re-parented to it and reaped, and it dies with the server.

`ZygoteClient` is the server's asyncio side of the control socket.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import itertools
import json
import os
import select
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from . import wire

MARKER = "marl-sandbox-zygote"
JAIL_UID_BASE = 990_000
"""First of the uids the jails run as when the server is root (namespaces tier)."""
_ROOT = str(Path(__file__).resolve().parents[2])
_PRELOAD = ("array", "bisect", "collections", "copy", "dataclasses", "datetime", "decimal",
            "fractions", "functools", "hashlib", "heapq", "itertools", "math", "operator",
            "random", "re", "statistics", "string", "textwrap", "typing", "unittest")
_BOOT = (
    "import sys; sys.path.insert(0, {root!r}); "
    "from services.reward_sandbox import zygote; zygote.main()"
)


def main() -> None:
    from . import namespaces, syscalls, tiers

    fd, server_pid, config = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
    sys.path.remove(_ROOT)
    ctl = socket.socket(fileno=fd)
    syscalls.prctl(syscalls.PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != server_pid:
        os._exit(0)
    sabotage = config["sabotage"]
    if not sabotage:
        syscalls.prctl(syscalls.PR_SET_CHILD_SUBREAPER, 1)
    for name in _PRELOAD:
        __import__(name)
    # Keep the collector away from everything imported so far: a collection in a
    # forked child would touch (and so copy) every page of the zygote's heap.
    gc.collect()
    gc.freeze()
    spec = {"root": namespaces.plan_root(config["tmp_bytes"], config["tmp_inodes"]).to_json(),
            "max_processes": config["max_processes"],
            "max_memory_bytes": config["max_memory_bytes"], "max_jobs": config["max_jobs"]}
    if sabotage:
        report: dict[str, Any] = {"tier": "none", "probes": {}}
    else:
        report = tiers.detect(spec, config["isolation"])
    spec["tier"] = report["tier"]
    wire.send_msg(ctl, {"ready": report})

    pool = _Pool(spec, ctl, config["warm_jails"])
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    pool.wake_fds = (wake_r, wake_w)
    pool.refill()
    while True:
        ready, _, _ = select.select([ctl.fileno(), wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 512)
            pool.reap()
        if ctl.fileno() in ready:
            got = wire.recv_msg(ctl)
            if got is None:
                for pid in pool.jobs:
                    _killpg(pid)
                os._exit(0)
            msg, fds = got
            pid = pool.dispatch(msg["spec"], fds)
            wire.send_msg(ctl, {"id": msg["id"], "pid": pid})
        if not select.select([ctl.fileno()], [], [], 0)[0]:
            pool.refill()


class _Pool:
    """Jails forked ahead of time, each waiting on its socket for one job."""

    def __init__(self, spec: dict[str, Any], ctl: socket.socket, size: int):
        self.spec = spec
        self.ctl = ctl
        self.size = size
        self.idle: list[tuple[int, socket.socket]] = []
        self.jobs: set[int] = set()
        self.wake_fds: tuple[int, int] = (-1, -1)
        self.devnull = os.open(os.devnull, os.O_RDWR)
        # A uid per live jail when root in the namespaces tier (see namespaces.enter);
        # freed uids go to the back of the line so a dying jail's is not reused at once.
        self.own_uids = spec["tier"] == "namespaces" and os.geteuid() == 0
        self.free_uids: collections.deque[int] = collections.deque()
        self.uids_made = 0
        self.uid_of: dict[int, int] = {}

    def fork_jail(self) -> None:
        from . import jail

        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        uid = self._take_uid() if self.own_uids else None
        pid = os.fork()
        if pid == 0:
            self.ctl.close()
            mine.close()
            for _, sock in self.idle:
                sock.close()
            for fd in self.wake_fds:
                os.close(fd)
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (0, 1, 2):
                os.dup2(self.devnull, fd)
            jail.warm(self.spec, theirs, uid)
        theirs.close()
        self.jobs.add(pid)
        if uid is not None:
            self.uid_of[pid] = uid
        self.idle.append((pid, mine))

    def _take_uid(self) -> int:
        if len(self.free_uids) > 4:
            return self.free_uids.popleft()
        self.uids_made += 1
        return JAIL_UID_BASE + self.uids_made - 1

    def refill(self) -> None:
        while len(self.idle) < self.size:
            self.fork_jail()

    def dispatch(self, spec: dict[str, Any], fds: list[int]) -> int:
        """Hand a job's descriptors to a warm jail; returns the jail's pid."""
        try:
            while True:
                if not self.idle:
                    self.fork_jail()
                pid, sock = self.idle.pop(0)
                try:
                    wire.send_msg(sock, {"spec": spec}, fds)
                    return pid
                except OSError:
                    _killpg(pid)
                finally:
                    sock.close()
        finally:
            for fd in fds:
                os.close(fd)

    def reap(self) -> None:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.jobs.discard(pid)
            if pid in self.uid_of:
                self.free_uids.append(self.uid_of.pop(pid))


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
        argv = [sys.executable, "-I", "-S", "-X", "utf8", "-c", _BOOT.format(root=_ROOT),
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
