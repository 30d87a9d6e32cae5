"""The zygote process: a single-threaded fork server that builds every job's jail.

`forkserver_client.ZygoteClient` starts it as `python -I -S -X utf8` with an empty
environment. It imports the jail code and the common standard-library modules
once, detects the isolation tier, and then forks jails ahead of time
(`warm_jails` of them), handing each the descriptors of one job. It never sees
job content. It is a child subreaper, so anything a job leaves behind is
re-parented to it and reaped, and it dies with the server.

Every jail, harness, template and candidate is a copy of this process, so what
it holds is paid for by every fork of every job (page tables, copy-on-write
faults, at-fork hooks): it imports neither asyncio, threading nor subprocess
(the server's side of the socket, in `forkserver_client`, does), and it freezes
its heap away from the garbage collector before the first fork.
"""

from __future__ import annotations

import collections
import gc
import json
import os
import select
import signal
import socket
import sys
from typing import Any

from . import candidate, harness, jail, landlock, namespaces, seccomp, syscalls, tiers, wire

JAIL_UID_BASE = 990_000
"""First of the uids the jails run as when the server is root (namespaces tier)."""
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
_PRELOAD = ("array", "bisect", "collections", "copy", "functools", "heapq", "itertools", "math",
            "operator", "re", "string", "textwrap", "typing")
"""What solutions commonly import (HumanEval's prompts `from typing import List`), and
small. Every module here makes every fork of every job dearer: the former list
(unittest, dataclasses, hashlib, statistics, datetime, decimal, fractions and random
besides) grew the zygote's heap, and every trivial job took more CPU for it
(bench/sandbox.py measures jobs/s). A job that imports one of those now pays for that
import itself."""


def main() -> None:
    fd, server_pid, config = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
    sys.path.remove(ROOT)
    syscalls.set_name("sbx-zygote")
    ctl = socket.socket(fileno=fd)
    syscalls.prctl(syscalls.PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != server_pid:
        os._exit(0)
    sabotage = config["sabotage"]
    if not sabotage:
        syscalls.prctl(syscalls.PR_SET_CHILD_SUBREAPER, 1)
    for name in _PRELOAD:
        __import__(name)
    if seccomp.supported():
        seccomp.prepare()
    candidate.prepare()
    plan = namespaces.plan_root(config["tmp_bytes"], config["tmp_inodes"])
    spec: dict[str, Any] = {"root": plan.to_json(), "max_processes": config["max_processes"],
                            "max_memory_bytes": config["max_memory_bytes"],
                            "max_jobs": config["max_jobs"]}
    if sabotage:
        report: dict[str, Any] = {"tier": "none", "probes": {}}
    else:
        report = tiers.detect(spec, config["isolation"])
    spec["tier"] = report["tier"]
    spec["pidfd"] = harness.pidfds_work()
    # below the namespaces tier, a job's writes are confined to its scratch where it can be
    spec["landlock"] = spec["tier"] in ("seccomp", "rlimits") and landlock.available()
    report["landlock"] = spec["landlock"]
    if spec["tier"] == "namespaces" and os.geteuid() == 0:
        # Jails will run as uids of their own (see _Pool): stage what they cannot
        # reach, once for all of them, in a mount namespace of the zygote's own.
        spec["staged"] = namespaces.stage_unreachable(plan.dirs)
    # Keep the collector away from everything made so far: a collection in a
    # forked child would touch (and so copy) every page of the zygote's heap.
    gc.collect()
    gc.freeze()
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
