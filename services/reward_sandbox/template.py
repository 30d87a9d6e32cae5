"""The template: forks a fresh candidate process on the harness's request.

Only a job with assert programs has one. The harness forks it once it has
read the public job and before it reads the secrets, so a candidate, which is
a copy of the template's memory, can never find an assert program (or any
nonce) in it, however many candidates the assert programs make the harness ask
for. It reaps candidates and reports each exit (status, CPU time) to the
harness, and kills a candidate when asked to. `become_candidate` is also what
the harness's own candidates run (see `harness.DirectSpawner`).
"""

from __future__ import annotations

import os
import select
import signal
import socket
from typing import Any, NoReturn

from . import candidate, syscalls, wire

_CHILD_FDS = 4


def serve(ctl: socket.socket, policy: dict[str, Any], code: str) -> NoReturn:
    syscalls.set_name("sbx-template")
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    live: set[int] = set()
    while True:
        ready, _, _ = select.select([ctl.fileno(), wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 512)
            while live:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
                if pid == 0:
                    break
                live.discard(pid)
                wire.send_msg(ctl, {"exit": pid, "status": status,
                                    "cpu": usage.ru_utime + usage.ru_stime})
        if ctl.fileno() not in ready:
            continue
        got = wire.recv_msg(ctl)
        if got is None:
            for pid in live:
                os.kill(pid, signal.SIGKILL)
            os._exit(0)
        msg, fds = got
        if msg["op"] == "kill":
            if msg["pid"] in live:
                os.kill(msg["pid"], signal.SIGKILL)
            continue
        pid = os.fork()
        if pid == 0:
            ctl.close()
            os.close(wake_r)
            os.close(wake_w)
            become_candidate(msg, fds, code, policy)
        for fd in fds:
            os.close(fd)
        live.add(pid)
        wire.send_msg(ctl, {"pid": pid})


def become_candidate(msg: dict[str, Any], fds: list[int], code: str,
                     policy: dict[str, Any]) -> NoReturn:
    """In a freshly forked child: keep only `fds` (as 0..3), confine, run the code.

    `msg`: the spawn request, `mode` ("main" or "serve") and `limits`."""
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        syscalls.prctl(syscalls.PR_SET_PDEATHSIG, signal.SIGKILL)
        syscalls.set_name("sbx-candidate")
        high = [os.dup(fd) for fd in fds]
        for target, fd in enumerate(high):
            os.dup2(fd, target)
        os.closerange(_CHILD_FDS, 1 << 16)
        candidate.confine(policy, msg["limits"])
    except BaseException:
        os._exit(70)
    if msg["mode"] == "main":
        candidate.run_main(code)
    candidate.run_serve(code)
