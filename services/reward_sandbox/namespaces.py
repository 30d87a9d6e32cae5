"""User, PID, network, mount, IPC and UTS namespaces and the jail's file system.

`enter()` runs in the job's outer process: it unshares every namespace and maps
the caller's uid/gid to root inside the new user namespace (root there has no
power outside it). `build_root()` runs in the first process of the new PID
namespace and replaces the file system with a minimal one:

- read-only binds of /usr, /bin, /lib*, /sbin, the Python installation and
  /etc/ld.so.cache; every site-packages/dist-packages below them is covered by
  an empty read-only tmpfs, so installed data sets are out of sight;
- /dev with only null, zero, full, random and urandom;
- a private, size- and inode-limited tmpfs at /tmp (the working directory);
- no /proc and no /sys, so no other process can be seen.

What it does not protect: files inside the bound system directories can be
read; a kernel bug in namespace code could be used to escape.
"""

from __future__ import annotations

import glob
import os
import signal
import sys
from typing import NamedTuple

from . import syscalls

ALL_FLAGS = (syscalls.CLONE_NEWUSER | syscalls.CLONE_NEWNS | syscalls.CLONE_NEWPID
             | syscalls.CLONE_NEWNET | syscalls.CLONE_NEWIPC | syscalls.CLONE_NEWUTS)
_NEW_ROOT = "/tmp"
_STAGE = "/var/tmp"
_DEVICES = ("null", "zero", "full", "random", "urandom")
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
_SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/localtime")
_PACKAGE_DIRS = ("lib/python3*/site-packages", "lib/python3*/dist-packages",
                 "lib/python3/dist-packages", "local/lib/python3*/site-packages",
                 "local/lib/python3*/dist-packages")


class RootPlan(NamedTuple):
    """What the jail's file system contains; computed once by the zygote.

    A NamedTuple, not a dataclass: `dataclasses` pulls in `inspect` and `ast`, heap in
    the zygote that every fork of every job would copy."""

    dirs: list[str]
    files: list[str]
    symlinks: dict[str, str]
    hidden: list[str]
    skeleton: list[str]
    """Directories to create in the new root, parents first (mount points and their parents)."""
    devices: list[str]
    tmp_bytes: int
    tmp_inodes: int

    def to_json(self) -> dict[str, object]:
        return self._asdict()


def plan_root(tmp_bytes: int, tmp_inodes: int) -> RootPlan:
    # Both spellings of the interpreter's prefix: sys.path uses the one it was
    # started with, module files may resolve to the real one.
    prefixes = {q for p in (sys.base_prefix, sys.base_exec_prefix)
                for q in (p, os.path.realpath(p))}
    dirs: list[str] = []
    symlinks: dict[str, str] = {}
    for path in [*_SYSTEM_DIRS, *sorted(prefixes)]:
        if os.path.islink(path):
            symlinks[path] = os.readlink(path)
        elif os.path.isdir(path) and not any(path.startswith(d + "/") for d in dirs):
            dirs.append(path)
    files = [f for f in _SYSTEM_FILES if os.path.isfile(f)]
    hidden = {p for root in dirs for pattern in _PACKAGE_DIRS
              for p in glob.glob(os.path.join(root, pattern))
              if os.path.isdir(p) and not os.path.islink(p)}
    devices = [name for name in _DEVICES if os.path.exists("/dev/" + name)]
    skeleton: dict[str, None] = {}
    for path in [*dirs, *(os.path.dirname(f) for f in files), "/dev", "/tmp"]:
        parts = path.strip("/").split("/")
        for i in range(1, len(parts) + 1):
            skeleton["/" + "/".join(parts[:i])] = None
    return RootPlan(dirs=dirs, files=files, symlinks=symlinks, hidden=sorted(hidden),
                    skeleton=list(skeleton), devices=devices, tmp_bytes=tmp_bytes,
                    tmp_inodes=tmp_inodes)


def enter(outside_id: int | None = None) -> None:
    """Unshare every namespace; the next fork becomes PID 1 of the new PID namespace.

    Root inside is the caller's own uid outside, or `outside_id` when given: a
    server running as root must give each jail an unprivileged uid of its own,
    because the kernel never applies RLIMIT_NPROC to processes of the real root
    uid, so a job's process and thread cap would not hold. Such a uid may not
    reach the Python installation: see `stage_unreachable`.
    """
    if outside_id is not None:
        os.setgroups([])
        os.setresgid(outside_id, outside_id, outside_id)
        os.setresuid(outside_id, outside_id, outside_id)
        # A change of credentials clears the parent-death signal and makes the
        # process non-dumpable (its /proc files root's); the jail turns dumpable
        # off again once confined.
        syscalls.prctl(syscalls.PR_SET_PDEATHSIG, signal.SIGKILL)
        syscalls.prctl(syscalls.PR_SET_DUMPABLE, 1)
    uid, gid = os.geteuid(), os.getegid()
    syscalls.unshare(ALL_FLAGS)
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"0 {uid} 1")
    _write("/proc/self/gid_map", f"0 {gid} 1")


def _searchable_by_anyone(path: str) -> bool:
    parts = os.path.abspath(path).split("/")
    return all(os.stat("/" + "/".join(parts[1:i])).st_mode & 0o001
               for i in range(1, len(parts) + 1))


def stage_unreachable(dirs: list[str]) -> dict[str, str]:
    """As root, once, in the zygote: bind each directory an unprivileged uid cannot
    reach (the Python installation below /root, say) under a world-searchable tmpfs,
    in a private mount namespace of the zygote's that every jail's own mount
    namespace then copies. Returns where `build_root` finds them."""
    hidden = [d for d in dirs if not _searchable_by_anyone(d)]
    if not hidden:
        return {}
    syscalls.unshare(syscalls.CLONE_NEWNS)
    syscalls.mount(None, "/", None, syscalls.MS_REC | syscalls.MS_PRIVATE)
    syscalls.mount("tmpfs", _STAGE, "tmpfs", syscalls.MS_NOSUID | syscalls.MS_NODEV,
                   "size=64k,nr_inodes=64,mode=0755")
    staged = {}
    for i, path in enumerate(hidden):
        target = f"{_STAGE}/{i}"
        os.mkdir(target)
        syscalls.mount(path, target, None, syscalls.MS_BIND | syscalls.MS_REC)
        staged[path] = target
    return staged


def build_root(plan: RootPlan, staged: dict[str, str] | None = None) -> None:
    """Pivot into a fresh minimal root; leaves the process in /tmp. `staged`: where
    the zygote put directories the jail's uid could not reach.

    Everything but /tmp is made read-only in one recursive pass before /tmp is
    mounted (the root tmpfs, the binds, the hidden tmpfs and /dev alike)."""
    staged = staged or {}
    ms = syscalls
    ms.mount(None, "/", None, ms.MS_REC | ms.MS_PRIVATE)
    new = _NEW_ROOT
    ms.mount("tmpfs", new, "tmpfs", ms.MS_NOSUID | ms.MS_NODEV, "size=1m,nr_inodes=512,mode=0755")
    for path in plan.skeleton:
        os.mkdir(new + path, 0o755)
    for path in plan.dirs:
        ms.mount(staged.get(path, path), new + path, None, ms.MS_BIND | ms.MS_REC)
    for path in plan.files:
        _touch(new + path)
        ms.mount(path, new + path, None, ms.MS_BIND)
    for path, dest in plan.symlinks.items():
        os.symlink(dest, new + path)
    for path in plan.hidden:
        ms.mount("tmpfs", new + path, "tmpfs", ms.MS_RDONLY | ms.MS_NOSUID | ms.MS_NODEV,
                 "size=4k,nr_inodes=4,mode=0555")
    dev = new + "/dev"
    ms.mount("tmpfs", dev, "tmpfs", ms.MS_NOSUID | ms.MS_NOEXEC, "size=64k,nr_inodes=16,mode=0755")
    for name in plan.devices:
        _touch(f"{dev}/{name}")
        ms.mount("/dev/" + name, f"{dev}/{name}", None, ms.MS_BIND)
    if not ms.readonly_tree(new):
        # No mount_setattr (Linux < 5.12): remount each mount on its own.
        for path in [*plan.dirs, *plan.files, "/dev", *(f"/dev/{n}" for n in plan.devices)]:
            ms.remount_readonly(new + path)
    ms.mount("tmpfs", new + "/tmp", "tmpfs", ms.MS_NOSUID | ms.MS_NODEV,
             f"size={plan.tmp_bytes},nr_inodes={plan.tmp_inodes},mode=1777")
    os.chdir(new)
    ms.pivot_root(".", ".")
    ms.umount2(".", ms.MNT_DETACH)
    os.chdir("/")
    ms.mount(None, "/", None,
             ms.MS_REMOUNT | ms.MS_BIND | ms.MS_RDONLY | ms.MS_NOSUID | ms.MS_NODEV)
    os.chdir("/tmp")
    ms.sethostname("sandbox")


def _touch(path: str) -> None:
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
