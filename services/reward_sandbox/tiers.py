"""Isolation tiers: what each one protects, and which one this kernel allows.

Tiers, strongest first; each includes the layers of the ones below it:

- `namespaces`: seccomp plus unprivileged user/PID/network/mount/IPC/UTS
  namespaces: no network interface at all, no other process visible, a
  read-only minimal root, a private size-limited /tmp.
- `seccomp`: rlimits plus the seccomp filters (no internet sockets, no
  connect, no ptrace, no exec, no fork, signals only to itself).
- `rlimits`: resource limits, a new session whose process group is killed at
  the end, a scratch directory removed afterwards, an empty environment,
  `python -I -S`, uid 65534 when the server runs as root.
- `none`: sabotage mode for tests only; nothing is isolated.

`detect()` probes each tier in a forked child, running the real jail set-up,
and returns the strongest one that worked. It must run in a single-threaded
process (the zygote, or `marl sandbox doctor`).
"""

from __future__ import annotations

import os
import select
import signal
import socket
import time
from typing import Any

ORDER = ("namespaces", "seccomp", "rlimits")

LAYERS: dict[str, list[tuple[str, str]]] = {
    "rlimits": [
        ("rlimits", "CPU time, address space, file size, open files and core dumps are "
                    "capped per candidate process; processes/threads per job in the "
                    "namespaces tier, per sandbox uid when run as root below it"),
        ("session", "each job is a new session; its whole process group is SIGKILLed when "
                    "the job ends, times out or its client goes away"),
        ("scratch", "the working directory is a fresh scratch directory removed afterwards"),
        ("environment", "empty environment, `python -I -S`: no server variables, no "
                        "site-packages on sys.path"),
        ("integrity", "expected outputs never enter the jail; verdicts are decided by the "
                      "server from plain values; a test passes only with a record carrying "
                      "its own nonce, read and written by the harness after the test ran"),
    ],
    "seccomp": [
        ("seccomp", "no internet, netlink or datagram sockets, no connect/bind, no ptrace or "
                    "process_vm_*, no exec, no fork (threads only), no setsid, signals only to "
                    "itself, no io_uring, bpf, keyrings, mounts or new namespaces; prlimit, "
                    "setpriority, sched_set*, ioprio_set, migrate/move_pages only on the "
                    "job's own process (pid 0), no process_madvise"),
        ("threads", "tasks per candidate capped (RLIMIT_NPROC): the uid's tasks when it "
                    "starts plus max_processes"),
        ("landlock", "where the kernel has Landlock (Info's probes say): writes only inside "
                     "the job's scratch directory, signals only within the job; TMPDIR is "
                     "the scratch directory"),
    ],
    "namespaces": [
        ("user namespace", "root inside maps to the server's uid outside; no capabilities "
                           "are left in the candidate"),
        ("network namespace", "no network interface at all (not even a working loopback)"),
        ("pid namespace", "no other process can be seen or signalled; the namespace dies "
                          "with the job"),
        ("mount namespace", "read-only minimal root (system libraries and the Python "
                            "standard library only), site-packages hidden, no /proc or /sys, "
                            "private size- and inode-limited /tmp"),
    ],
}

NOT_PROTECTED = [
    "kernel bugs reachable through allowed system calls",
    "reading world-readable files of the system directories (and, below the namespaces tier, "
    "any file the sandbox uid may read)",
    "below the namespaces tier on a kernel without Landlock: writes to world-writable host "
    "directories such as /tmp; jobs of the same uid reading each other's scratch "
    "directories",
    "in the rlimits tier (no seccomp): network access, fork, exec, and signals to any process "
    "of the sandbox uid (the server's own uid unless it runs as root)",
    "host memory pressure from memfds and tmpfs pages (bounded by the file-size limit and "
    "the tmpfs size, not by the address-space limit)",
    "timing side channels and CPU contention between concurrent jobs",
]


def layers(tier: str) -> list[tuple[str, str]]:
    if tier == "none":
        return [("none", "SABOTAGE MODE: nothing is isolated; for tests only")]
    out: list[tuple[str, str]] = []
    for name in reversed(ORDER):
        out += LAYERS[name]
        if name == tier:
            break
    return out


def allowed(ceiling: str) -> tuple[str, ...]:
    """The tiers to try, strongest first, at most `ceiling` (auto = all)."""
    if ceiling == "auto":
        return ORDER
    return ORDER[ORDER.index(ceiling):]


def detect(spec: dict[str, Any], ceiling: str = "auto",
           timeout: float = 10.0) -> dict[str, Any]:
    """Probe the tiers; {'tier': best, 'probes': {tier: 'ok' or the error}}."""
    probes: dict[str, str] = {}
    best = "rlimits"
    for tier in allowed(ceiling):
        result = probe(tier, spec, timeout)
        probes[tier] = result
        if result == "ok":
            best = tier
            break
    return {"tier": best, "probes": probes}


def probe(tier: str, spec: dict[str, Any], timeout: float) -> str:
    """Run the jail set-up of `tier` in a child and check that its layers bite."""
    from . import jail  # imported late: jail imports the harness and its helpers

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        message = "ok"
        try:
            os.setsid()
            jail.enter(tier, {**spec, "scratch": "/"}, [w])
            _self_test(tier)
        except BaseException as e:  # anything that fails means the tier is unusable
            message = f"{type(e).__name__}: {e}"
        os.write(w, message.encode()[:4000])
        os._exit(0)
    os.close(w)
    deadline = time.monotonic() + timeout
    chunks = []
    while time.monotonic() < deadline:
        ready, _, _ = select.select([r], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        data = os.read(r, 4096)
        if not data:
            break
        chunks.append(data)
    os.close(r)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)
    return b"".join(chunks).decode(errors="replace") or "probe died without a report"


def _self_test(tier: str) -> None:
    if tier == "rlimits":
        return
    try:
        socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()
    except PermissionError:
        pass
    else:
        raise RuntimeError("seccomp filter loaded but an internet socket was allowed")
    if tier == "namespaces" and (os.path.exists("/proc/self") or os.getuid() != 0):
        raise RuntimeError("mount/user namespace set-up did not take effect")
