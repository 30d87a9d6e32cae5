"""Landlock for jobs below the namespaces tier: no file written outside the job's scratch
directory, and no signal to a process outside the job.

Below the namespaces tier a job sees the host's file system as the sandbox uid does, so
a job could leave files in /tmp (or any directory that uid may write) that outlive it.
Landlock (Linux 5.13+, unprivileged, stacked on the seccomp filter) confines every
write-like access (create, write, truncate, remove, rename, link) to the scratch
directory, which the server removes after the job; reads are left as the seccomp tier
has them. /dev/null stays writable. With ABI 6 (Linux 6.12+) the job is also scoped:
its processes may signal only processes of its own Landlock domain (its own), and
connect to no abstract Unix socket outside it.

What it does not protect: a kernel without Landlock (`available()` is False: the job
then runs with TMPDIR pointing at its scratch, and files it names elsewhere stay
behind, as the tier's report says); memfds and pipes, which are not files on a path.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct

from . import syscalls

_SYS = {"create_ruleset": 444, "add_rule": 445, "restrict_self": 446}  # every architecture
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1

WRITE_FILE = 1 << 1
REMOVE_DIR = 1 << 4
REMOVE_FILE = 1 << 5
MAKE_CHAR = 1 << 6
MAKE_DIR = 1 << 7
MAKE_REG = 1 << 8
MAKE_SOCK = 1 << 9
MAKE_FIFO = 1 << 10
MAKE_BLOCK = 1 << 11
MAKE_SYM = 1 << 12
REFER = 1 << 13  # ABI 2
TRUNCATE = 1 << 14  # ABI 3
SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
SCOPE_SIGNAL = 1 << 1  # ABI 6

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def abi() -> int:
    """The kernel's Landlock ABI version; 0 when it has none (or a filter refuses it)."""
    got = _libc.syscall(_SYS["create_ruleset"], None, 0, _CREATE_RULESET_VERSION)
    return max(0, int(got))


def available() -> bool:
    return abi() >= 1


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"landlock {what}: {os.strerror(err)}")
    return result


def restrict_writes_to(scratch: str) -> None:
    """Confine this process and every process it forks from now on: write-like accesses
    only beneath `scratch` (and to /dev/null), and with ABI 6 signals only within. Needs
    no_new_privs (set with the seccomp filter) and is irreversible."""
    version = abi()
    if version < 1:
        raise OSError(errno.ENOSYS, "landlock is not available on this kernel")
    handled = (WRITE_FILE | REMOVE_DIR | REMOVE_FILE | MAKE_CHAR | MAKE_DIR | MAKE_REG
               | MAKE_SOCK | MAKE_FIFO | MAKE_BLOCK | MAKE_SYM)
    if version >= 2:
        handled |= REFER
    if version >= 3:
        handled |= TRUNCATE
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if version >= 6 else 0
    # struct landlock_ruleset_attr {u64 handled_access_fs, handled_access_net, scoped}
    attr = struct.pack("QQQ", handled, 0, scoped) if scoped else struct.pack("Q", handled)
    buf = ctypes.create_string_buffer(attr, len(attr))
    ruleset = _check(_libc.syscall(_SYS["create_ruleset"], buf, len(attr), 0), "ruleset")
    try:
        file_rights = WRITE_FILE | (TRUNCATE if version >= 3 else 0)
        for path, rights in ((scratch, handled), ("/dev/null", file_rights)):
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                # struct landlock_path_beneath_attr {u64 allowed_access; s32 parent_fd} packed
                rule = struct.pack("=Qi", rights, fd)
                rule_buf = ctypes.create_string_buffer(rule, len(rule))
                _check(_libc.syscall(_SYS["add_rule"], ruleset, _RULE_PATH_BENEATH,
                                     rule_buf, 0), f"rule for {path}")
            finally:
                os.close(fd)
        syscalls.prctl(syscalls.PR_SET_NO_NEW_PRIVS, 1)
        _check(_libc.syscall(_SYS["restrict_self"], ruleset, 0), "restrict_self")
    finally:
        os.close(ruleset)
