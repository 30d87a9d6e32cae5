"""A job's jail: built ahead of time by the zygote, then handed one job.

The zygote keeps a few jails warm, so a job's latency does not include
building one. A jail is forked with a socket to the zygote and, before any job
exists:

1. starts a new session, so the job will be one process group the server
   can kill;
2. `namespaces` tier: new user/PID/network/mount/IPC/UTS namespaces and a
   minimal read-only root with a private /tmp (see `namespaces`); the outer
   process stays behind as the group leader until the server kills the group;
   lower tiers: uid 65534 when started as root;
3. loads the base seccomp filter (`seccomp` and `namespaces` tiers);
4. becomes non-dumpable, so no candidate can ptrace it or read its memory.

Below the namespaces tier, once its job arrives, it confines every write to the job's
scratch directory with Landlock where the kernel has it (`landlock`), and points TMPDIR
there.

Then it waits for the job: four descriptors (public job, secrets, nonces,
record pipe) and the scratch directory for tiers below `namespaces`, and
hands them to the harness (see `harness` for who forks the candidates and
when the secrets are read). After the last record the jail waits to be killed
with its whole process group, so nothing a job started outlives it. A jail whose
set-up failed still takes its job and reports the failure on the record pipe.
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import traceback
from typing import Any, NoReturn

from . import landlock, naive, namespaces, seccomp, syscalls, wire
from .harness import Harness

NOBODY = 65534


def warm(spec: dict[str, Any], sock: socket.socket, uid: int | None = None) -> NoReturn:
    """Entry of a freshly forked jail; never returns. `uid`: the jail's own uid outside
    its user namespace (namespaces tier, server running as root)."""
    tier = spec["tier"]
    failure = ""
    harness: Harness | None = None
    try:
        syscalls.prctl(syscalls.PR_SET_PDEATHSIG, signal.SIGKILL)
        syscalls.set_name("sbx-outer")
        if tier != "none":
            os.setsid()
        policy = enter(tier, spec, [sock.fileno()], uid)
        if tier != "none":
            harness = Harness(policy, direct_spawn=bool(spec.get("pidfd")))
    except BaseException as e:  # reported to the job that comes, not lost
        failure = "jail set-up failed: " + "".join(traceback.format_exception_only(e))
    got = wire.recv_msg(sock)
    if got is None:
        os._exit(0)
    msg, (job_fd, sec_fd, nonce_fd, rec_fd) = got
    sock.close()
    try:
        if failure:
            raise RuntimeError(failure)
        scratch = msg["spec"].get("scratch")
        if scratch:
            os.chdir(scratch)
            if spec.get("landlock"):
                landlock.restrict_writes_to(scratch)
            # a job's temporary files go to its scratch, which is removed after it
            os.environ["TMPDIR"] = scratch
        if harness is None:
            naive.run(wire.read_json_fd(job_fd), rec_fd, sec_fd, nonce_fd)
            os._exit(0)
        harness.run(job_fd, sec_fd, nonce_fd, rec_fd)
    except BaseException as e:  # report why the job failed instead of dying silently
        try:
            wire.write_frame(rec_fd, {"fatal": "".join(traceback.format_exception_only(e))})
        finally:
            os._exit(71)
    os.close(rec_fd)
    _wait_to_be_killed()


def enter(tier: str, spec: dict[str, Any], keep: list[int],
          uid: int | None = None) -> dict[str, Any]:
    """Confine this process for `tier`; returns the policy the candidates apply.

    In the namespaces tier this forks: the caller's process stays outside,
    closes `keep` and waits to be killed; the child returns.
    """
    policy: dict[str, Any] = {"rlimits": tier != "none", "namespaces": tier == "namespaces",
                              "seccomp": tier in ("namespaces", "seccomp"), "nproc": 0,
                              "baseline_vsz": _vsz() + (32 << 20)}
    if tier == "namespaces":
        plan = namespaces.RootPlan(**spec["root"])
        namespaces.enter(uid)
        pid = os.fork()
        if pid:
            for fd in keep:
                os.close(fd)
            os.waitpid(pid, 0)
            _wait_to_be_killed()
        syscalls.prctl(syscalls.PR_SET_PDEATHSIG, signal.SIGKILL)
        syscalls.set_name("sbx-harness")
        namespaces.build_root(plan, spec.get("staged"))
        # Root of the new user namespace needed its capabilities to build the
        # root; nothing after this does (the harness runs client assert programs).
        syscalls.drop_capabilities()
        policy["nproc"] = spec["max_processes"]
    elif tier != "none" and os.geteuid() == 0:
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
        # Every job shares uid 65534 here, so the process cap is shared too.
        policy["nproc"] = spec["max_processes"] * spec["max_jobs"]
    elif tier != "none":
        # the jobs share the server's uid: each candidate may add max_processes tasks to
        # those its uid runs when it starts (candidate.confine counts them)
        policy["nproc_above_uid"] = spec["max_processes"]
    if policy["seccomp"]:
        seccomp.install_base()
    if tier != "none":
        syscalls.prctl(syscalls.PR_SET_DUMPABLE, 0)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        # The harness runs the client's assert programs: bound its memory too, above
        # any candidate's limit (a candidate can lower a limit but not raise it).
        harness_memory = policy["baseline_vsz"] + spec["max_memory_bytes"] + (256 << 20)
        resource.setrlimit(resource.RLIMIT_AS, (harness_memory, harness_memory))
    return policy


def _vsz() -> int:
    fd = os.open("/proc/self/statm", os.O_RDONLY)
    try:
        return int(os.read(fd, 256).split()[0]) * os.sysconf("SC_PAGE_SIZE")
    finally:
        os.close(fd)


def _wait_to_be_killed() -> NoReturn:
    while True:
        signal.pause()
