"""Thin ctypes wrappers over the Linux calls the jail needs and Python 3.11 lacks.

unshare, mount, umount2, pivot_root, mount_setattr, prctl, capset and
sethostname. Each raises OSError with the errno on failure. Nothing here decides
policy; `namespaces`, `seccomp` and `jail` do. The ctypes structures are
defined once, at import in the zygote, not on every call in every jail.
"""

from __future__ import annotations

import ctypes
import os

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

MACHINE = os.uname().machine

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_THREAD = 0x00010000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21
MNT_DETACH = 2

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_NAME = 15
PR_SET_SECCOMP = 22
PR_SET_NO_NEW_PRIVS = 38
PR_SET_CHILD_SUBREAPER = 36
SECCOMP_MODE_FILTER = 2

# statvfs f_flag bit -> mount flag, so a read-only remount keeps the flags the
# kernel locked when the mount was inherited into our user namespace.
_STATVFS_TO_MS = {
    os.ST_NOSUID: MS_NOSUID,
    os.ST_NODEV: MS_NODEV,
    os.ST_NOEXEC: MS_NOEXEC,
    os.ST_NOATIME: MS_NOATIME,
    os.ST_NODIRATIME: MS_NODIRATIME,
    os.ST_RELATIME: MS_RELATIME,
}

_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(MACHINE)
_SYS_MOUNT_SETATTR = 442  # same number on x86_64 and aarch64 (5.12+)
_MOUNT_ATTR_RDONLY = 0x1
_AT_RECURSIVE = 0x8000
_AT_FDCWD = -100


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), "unshare")


def mount(source: str | None, target: str, fstype: str | None, flags: int,
          data: str | None = None) -> None:
    def b(s: str | None) -> bytes | None:
        return s.encode() if s is not None else None

    ret = _libc.mount(b(source), target.encode(), b(fstype), ctypes.c_ulong(flags), b(data))
    _check(ret, f"mount {source or fstype} on {target}")


def umount2(target: str, flags: int) -> None:
    _check(_libc.umount2(target.encode(), ctypes.c_int(flags)), f"umount {target}")


def pivot_root(new_root: str, put_old: str) -> None:
    if _SYS_PIVOT_ROOT is None:
        raise OSError(38, f"pivot_root: unsupported architecture {MACHINE}")
    _check(_libc.syscall(_SYS_PIVOT_ROOT, new_root.encode(), put_old.encode()), "pivot_root")


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def readonly_tree(target: str) -> bool:
    """Make the mount at `target` and every mount below it read-only (mount_setattr);
    False where the kernel lacks it (before 5.12)."""
    attr = _MountAttr(_MOUNT_ATTR_RDONLY, 0, 0, 0)
    ret = _libc.syscall(_SYS_MOUNT_SETATTR, _AT_FDCWD, target.encode(), _AT_RECURSIVE,
                        ctypes.byref(attr), ctypes.sizeof(attr))
    return bool(ret == 0)


def remount_readonly(target: str) -> None:
    """Make the mount at `target` (and, where the kernel allows, its submounts) read-only."""
    if readonly_tree(target):
        return
    kept = 0
    f_flag = os.statvfs(target).f_flag
    for st, ms in _STATVFS_TO_MS.items():
        if f_flag & st:
            kept |= ms
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept)


def prctl(option: int, arg2: int = 0, arg3: int = 0) -> None:
    ret = _libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg2), ctypes.c_ulong(arg3),
                      ctypes.c_ulong(0), ctypes.c_ulong(0))
    _check(ret, f"prctl({option})")


def prctl_ptr(option: int, arg2: int, ptr: ctypes._Pointer) -> None:  # type: ignore[type-arg]
    ret = _libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg2), ptr,
                      ctypes.c_ulong(0), ctypes.c_ulong(0))
    _check(ret, f"prctl({option})")


def set_name(name: str) -> None:
    """Name this process as ps, top and perf show it (`comm`, at most 15 bytes)."""
    ret = _libc.prctl(ctypes.c_int(PR_SET_NAME), ctypes.c_char_p(name.encode()[:15]),
                      ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
    _check(ret, "prctl(PR_SET_NAME)")


def drop_capabilities() -> None:
    """Clear the effective, permitted and inheritable sets (capset v3)."""
    header = _CapHeader(0x20080522, 0)
    data = (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(header), ctypes.byref(data)), "capset")


def sethostname(name: str) -> None:
    raw = name.encode()
    _check(_libc.sethostname(raw, ctypes.c_size_t(len(raw))), "sethostname")
