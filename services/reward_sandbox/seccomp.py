"""Seccomp-BPF filters for the jail, assembled in pure Python (no libseccomp).

Two filters stack. The *base* filter covers every process of a job (harness,
template, candidate): no internet, netlink or datagram sockets (only Unix
stream/seqpacket pairs), no connect/bind/listen, no ptrace or
process_vm_readv/writev, no new namespaces, no mounts, no io_uring (it would
bypass this filter), no bpf, perf, keyrings, kexec, modules or
open_by_handle_at, and the calls that act on another process by its pid
(prlimit64, sched_setaffinity/setparam/setscheduler/setattr, migrate_pages,
move_pages) only on the caller itself (pid 0), setpriority and ioprio_set only on
the caller or its own process group (who 0), process_madvise/process_mrelease not
at all: a job cannot re-limit, renice, re-pin or page out its zygote, the server or
another job of the same uid. The *strict* filter is added in the candidate process
only: no execve, no fork/vfork/clone of a new process (threads are allowed), no
setsid/setpgid, no pidfds, and signals only to itself.

What it does not protect: syscalls not listed here are allowed (reading files,
writing inside the scratch area, threads, memory); a kernel bug reachable from
an allowed syscall is not stopped. Only x86_64 and aarch64 are supported; on
any other machine `supported()` is False and the sandbox runs without seccomp.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import socket
import struct

from . import syscalls

_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}

_X86_64 = {
    "socket": 41, "connect": 42, "accept": 43, "sendto": 44, "bind": 49, "listen": 50,
    "socketpair": 53, "clone": 56, "fork": 57, "vfork": 58, "execve": 59, "kill": 62,
    "ptrace": 101, "syslog": 103, "setpgid": 109, "setsid": 112, "rt_sigqueueinfo": 129,
    "uselib": 134, "personality": 135, "vhangup": 153, "pivot_root": 155, "chroot": 161,
    "acct": 163, "mount": 165, "umount2": 166, "swapon": 167, "swapoff": 168, "reboot": 169,
    "sethostname": 170, "setdomainname": 171, "iopl": 172, "ioperm": 173,
    "init_module": 175, "delete_module": 176, "quotactl": 179, "tkill": 200,
    "lookup_dcookie": 212, "tgkill": 234, "kexec_load": 246, "add_key": 248,
    "request_key": 249, "keyctl": 250, "unshare": 272, "accept4": 288,
    "rt_tgsigqueueinfo": 297, "perf_event_open": 298, "fanotify_init": 300,
    "name_to_handle_at": 303, "open_by_handle_at": 304, "setns": 308,
    "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312, "finit_module": 313,
    "kexec_file_load": 320, "bpf": 321, "execveat": 322, "userfaultfd": 323,
    "setpriority": 141, "sched_setparam": 142, "sched_setscheduler": 144,
    "migrate_pages": 256, "move_pages": 279, "sched_setaffinity": 203, "ioprio_set": 251,
    "prlimit64": 302, "sched_setattr": 314,
}
_AARCH64 = {
    "lookup_dcookie": 18, "umount2": 39, "mount": 40, "pivot_root": 41, "chroot": 51,
    "vhangup": 58, "quotactl": 60, "acct": 89, "personality": 92, "unshare": 97,
    "kexec_load": 104, "init_module": 105, "delete_module": 106, "syslog": 116,
    "ptrace": 117, "kill": 129, "tkill": 130, "tgkill": 131, "rt_sigqueueinfo": 138,
    "reboot": 142, "setpgid": 154, "setsid": 157, "sethostname": 161, "setdomainname": 162,
    "socket": 198, "socketpair": 199, "bind": 200, "listen": 201, "accept": 202,
    "connect": 203, "sendto": 206, "add_key": 217, "request_key": 218, "keyctl": 219,
    "clone": 220, "execve": 221, "swapon": 224, "swapoff": 225, "rt_tgsigqueueinfo": 240,
    "perf_event_open": 241, "accept4": 242, "fanotify_init": 262, "name_to_handle_at": 264,
    "open_by_handle_at": 265, "setns": 268, "process_vm_readv": 270,
    "process_vm_writev": 271, "kcmp": 272, "finit_module": 273, "bpf": 280,
    "execveat": 281, "userfaultfd": 282, "kexec_file_load": 294,
    "ioprio_set": 30, "sched_setparam": 118, "sched_setscheduler": 119,
    "sched_setaffinity": 122, "setpriority": 140, "migrate_pages": 238, "move_pages": 239,
    "prlimit64": 261, "sched_setattr": 274,
}
# Numbers shared by every architecture since Linux 5.1.
_COMMON = {
    "pidfd_send_signal": 424, "io_uring_setup": 425, "io_uring_enter": 426,
    "io_uring_register": 427, "open_tree": 428, "move_mount": 429, "fsopen": 430,
    "fsconfig": 431, "fsmount": 432, "fspick": 433, "pidfd_open": 434, "clone3": 435,
    "pidfd_getfd": 438, "process_madvise": 440, "mount_setattr": 442,
    "process_mrelease": 448,
}
_TABLES = {"x86_64": {**_X86_64, **_COMMON}, "aarch64": {**_AARCH64, **_COMMON}}

_BASE_DENY = (
    "ptrace", "process_vm_readv", "process_vm_writev", "kexec_load", "kexec_file_load",
    "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key", "mount",
    "umount2", "pivot_root", "chroot", "unshare", "setns", "io_uring_setup",
    "io_uring_enter", "io_uring_register", "init_module", "finit_module", "delete_module",
    "reboot", "swapon", "swapoff", "acct", "quotactl", "open_by_handle_at",
    "name_to_handle_at", "fanotify_init", "lookup_dcookie", "vhangup", "uselib", "iopl",
    "ioperm", "syslog", "personality", "open_tree", "move_mount", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr", "pidfd_getfd", "kcmp", "sethostname",
    "setdomainname", "connect", "bind", "listen", "accept", "accept4", "process_madvise",
    "process_mrelease",
)
_SELF_ONLY = ("prlimit64", "sched_setaffinity", "sched_setparam", "sched_setscheduler",
              "sched_setattr", "migrate_pages", "move_pages")
"""Calls whose first argument is a pid: allowed on pid 0 (the caller) only."""
_WHO_SELF_ONLY = {"setpriority": (0, 1), "ioprio_set": (1, 2)}
"""Calls taking (which, who): allowed only with who 0 and `which` one of these (the
process itself or its process group, never a user's processes)."""
_STRICT_DENY = ("execve", "execveat", "fork", "vfork", "setsid", "setpgid",
                "pidfd_send_signal", "pidfd_open")
_SIGNAL_CALLS = ("kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")
_NEW_NAMESPACE_FLAGS = (syscalls.CLONE_NEWNS | syscalls.CLONE_NEWUTS | syscalls.CLONE_NEWIPC
                        | syscalls.CLONE_NEWUSER | syscalls.CLONE_NEWPID
                        | syscalls.CLONE_NEWNET | 0x02000000)  # CLONE_NEWCGROUP

_LD_ABS = 0x20
_JEQ = 0x15
_JSET = 0x45
_AND = 0x54
_RET = 0x06
_ALLOW = 0x7FFF0000
_KILL_PROCESS = 0x80000000
_X32_BIT = 0x40000000


def _errno(code: int) -> int:
    return 0x00050000 | code


def _arg_lo(i: int) -> int:
    return 16 + 8 * i


Insn = tuple[int, int, int, int]


def _guarded(nr: int, body: list[Insn]) -> list[Insn]:
    """Run `body` (which always returns) when the syscall number is `nr`."""
    return [(_JEQ, 0, len(body), nr), *body]


def _deny(nr: int, code: int = errno.EPERM) -> list[Insn]:
    return _guarded(nr, [(_RET, 0, 0, _errno(code))])


def _unix_stream_only(nr: int) -> list[Insn]:
    deny = _errno(errno.EACCES)
    return _guarded(nr, [
        (_LD_ABS, 0, 0, _arg_lo(0)),
        (_JEQ, 0, 4, socket.AF_UNIX),
        (_LD_ABS, 0, 0, _arg_lo(1)),
        (_AND, 0, 0, 0xF),
        (_JEQ, 2, 0, socket.SOCK_STREAM),
        (_JEQ, 1, 0, socket.SOCK_SEQPACKET),
        (_RET, 0, 0, deny),
        (_RET, 0, 0, _ALLOW),
    ])


def _null_arg(nr: int, arg: int) -> list[Insn]:
    return _guarded(nr, [
        (_LD_ABS, 0, 0, _arg_lo(arg)),
        (_JEQ, 0, 2, 0),
        (_LD_ABS, 0, 0, _arg_lo(arg) + 4),
        (_JEQ, 1, 0, 0),
        (_RET, 0, 0, _errno(errno.EPERM)),
        (_RET, 0, 0, _ALLOW),
    ])


def _arg_equals(nr: int, arg: int, value: int) -> list[Insn]:
    return _guarded(nr, [
        (_LD_ABS, 0, 0, _arg_lo(arg)),
        (_JEQ, 1, 0, value & 0xFFFFFFFF),
        (_RET, 0, 0, _errno(errno.EPERM)),
        (_RET, 0, 0, _ALLOW),
    ])


def _pid_zero(nr: int, arg: int) -> list[Insn]:
    """Allow `nr` only when argument `arg` (a pid_t, so its low 32 bits) is 0."""
    return _guarded(nr, [
        (_LD_ABS, 0, 0, _arg_lo(arg)),
        (_JEQ, 1, 0, 0),
        (_RET, 0, 0, _errno(errno.EPERM)),
        (_RET, 0, 0, _ALLOW),
    ])


def _which_who_self(nr: int, whiches: tuple[int, int]) -> list[Insn]:
    """Allow `nr(which, who, ...)` only with who 0 and which in `whiches`."""
    return _guarded(nr, [
        (_LD_ABS, 0, 0, _arg_lo(1)),
        (_JEQ, 0, 3, 0),
        (_LD_ABS, 0, 0, _arg_lo(0)),
        (_JEQ, 2, 0, whiches[0]),
        (_JEQ, 1, 0, whiches[1]),
        (_RET, 0, 0, _errno(errno.EPERM)),
        (_RET, 0, 0, _ALLOW),
    ])


def _flags_clear(nr: int, mask: int) -> list[Insn]:
    return _guarded(nr, [
        (_LD_ABS, 0, 0, _arg_lo(0)),
        (_JSET, 0, 1, mask),
        (_RET, 0, 0, _errno(errno.EPERM)),
        (_RET, 0, 0, _ALLOW),
    ])


def _flags_set(nr: int, mask: int) -> list[Insn]:
    return _guarded(nr, [
        (_LD_ABS, 0, 0, _arg_lo(0)),
        (_JSET, 1, 0, mask),
        (_RET, 0, 0, _errno(errno.EPERM)),
        (_RET, 0, 0, _ALLOW),
    ])


def _program(rules: list[Insn]) -> list[Insn]:
    arch = _AUDIT_ARCH[syscalls.MACHINE]
    head: list[Insn] = [
        (_LD_ABS, 0, 0, 4),
        (_JEQ, 1, 0, arch),
        (_RET, 0, 0, _KILL_PROCESS),
        (_LD_ABS, 0, 0, 0),
    ]
    if syscalls.MACHINE == "x86_64":
        head += [(_JSET, 0, 1, _X32_BIT), (_RET, 0, 0, _errno(errno.EPERM))]
    return [*head, *rules, (_RET, 0, 0, _ALLOW)]


def supported() -> bool:
    return syscalls.MACHINE in _TABLES


def base_program() -> list[Insn]:
    t = _TABLES[syscalls.MACHINE]
    rules: list[Insn] = []
    for name in _BASE_DENY:
        if name in t:
            rules += _deny(t[name])
    rules += _unix_stream_only(t["socket"])
    rules += _unix_stream_only(t["socketpair"])
    rules += _null_arg(t["sendto"], 4)
    rules += _flags_clear(t["clone"], _NEW_NAMESPACE_FLAGS)
    for name in _SELF_ONLY:
        rules += _pid_zero(t[name], 0)
    for name, whiches in _WHO_SELF_ONLY.items():
        rules += _which_who_self(t[name], whiches)
    # glibc falls back to clone() when clone3 says ENOSYS; clone3's flags are
    # behind a pointer that BPF cannot read.
    rules += _deny(t["clone3"], errno.ENOSYS)
    return _program(rules)


def _strict_rules() -> list[Insn]:
    """The strict filter's rules that do not depend on the candidate's pid."""
    t = _TABLES[syscalls.MACHINE]
    rules: list[Insn] = []
    for name in _STRICT_DENY:
        if name in t:
            rules += _deny(t[name])
    rules += _flags_set(t["clone"], syscalls.CLONE_THREAD)
    return rules


def _signal_rules(own_pid: int) -> list[Insn]:
    t = _TABLES[syscalls.MACHINE]
    rules: list[Insn] = []
    for name in _SIGNAL_CALLS:
        rules += _arg_equals(t[name], 0, own_pid)
    return rules


def strict_program(own_pid: int) -> list[Insn]:
    return _program(_strict_rules() + _signal_rules(own_pid))


_INSN = struct.Struct("HBBI")


class _Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def pack(program: list[Insn]) -> bytes:
    """A program as the kernel reads it (struct sock_filter[])."""
    return b"".join(_INSN.pack(*insn) for insn in program)


@functools.cache
def _base_packed() -> bytes:
    return pack(base_program())


@functools.cache
def _strict_head() -> bytes:
    return pack(_program(_strict_rules())[:-1])


def strict_packed(own_pid: int) -> bytes:
    """`pack(strict_program(own_pid))`, from a head packed once in the zygote."""
    return _strict_head() + pack(_signal_rules(own_pid) + [(_RET, 0, 0, _ALLOW)])


def prepare() -> None:
    """Pack the pid-independent filters now, so every process forked later shares them."""
    _base_packed()
    _strict_head()


def install(program: list[Insn]) -> None:
    """Load `program` into this process (and every child it forks from now on)."""
    install_packed(pack(program))


def install_base() -> None:
    """`install(base_program())`."""
    install_packed(_base_packed())


def install_strict(own_pid: int) -> None:
    """`install(strict_program(own_pid))`."""
    install_packed(strict_packed(own_pid))


def install_packed(raw: bytes) -> None:
    buf = ctypes.create_string_buffer(raw, len(raw))
    prog = _Fprog(len(raw) // _INSN.size, ctypes.addressof(buf))
    syscalls.prctl(syscalls.PR_SET_NO_NEW_PRIVS, 1)
    syscalls.prctl_ptr(syscalls.PR_SET_SECCOMP, syscalls.SECCOMP_MODE_FILTER,
                       ctypes.pointer(prog))
