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
from dataclasses import asdict, dataclass, field

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


@dataclass
class RootPlan:
    """What the jail's file system contains; computed once by the zygote."""

    dirs: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    symlinks: dict[str, str] = field(default_factory=dict)
    hidden: list[str] = field(default_factory=list)
    tmp_bytes: int = 64 * 1024 * 1024
    tmp_inodes: int = 2048

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def plan_root(tmp_bytes: int, tmp_inodes: int) -> RootPlan:
    plan = RootPlan(tmp_bytes=tmp_bytes, tmp_inodes=tmp_inodes)
    # Both spellings of the interpreter's prefix: sys.path uses the one it was
    # started with, module files may resolve to the real one.
    prefixes = {q for p in (sys.base_prefix, sys.base_exec_prefix)
                for q in (p, os.path.realpath(p))}
    for path in [*_SYSTEM_DIRS, *sorted(prefixes)]:
        if os.path.islink(path):
            plan.symlinks[path] = os.readlink(path)
        elif os.path.isdir(path) and not any(
            path.startswith(d + "/") for d in plan.dirs
        ):
            plan.dirs.append(path)
    plan.files = [f for f in _SYSTEM_FILES if os.path.isfile(f)]
    hidden = {p for root in plan.dirs for pattern in _PACKAGE_DIRS
              for p in glob.glob(os.path.join(root, pattern))
              if os.path.isdir(p) and not os.path.islink(p)}
    plan.hidden = sorted(hidden)
    return plan


def enter(outside_id: int | None = None, plan: RootPlan | None = None) -> dict[str, str]:
    """Unshare every namespace; the next fork becomes PID 1 of the new PID namespace.

    Root inside is the caller's own uid outside, or `outside_id` when given: a
    server running as root must give each jail an unprivileged uid of its own,
    because the kernel never applies RLIMIT_NPROC to processes of the real root
    uid, so a job's process and thread cap would not hold. Returns where
    `build_root` finds the plan's directories that uid could not reach itself.
    """
    staged: dict[str, str] = {}
    if outside_id is not None:
        staged = _stage_unreachable(plan.dirs if plan is not None else [])
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
    return staged


def _searchable_by_anyone(path: str) -> bool:
    parts = os.path.abspath(path).split("/")
    return all(os.stat("/" + "/".join(parts[1:i])).st_mode & 0o001
               for i in range(1, len(parts) + 1))


def _stage_unreachable(dirs: list[str]) -> dict[str, str]:
    """While still root: bind each directory an unprivileged uid cannot reach (the
    Python installation below /root, say) under a world-searchable tmpfs, in a
    private mount namespace the jail's own namespaces then copy."""
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
    `enter` put directories the jail's uid could not reach."""
    staged = staged or {}
    syscalls.mount(None, "/", None, syscalls.MS_REC | syscalls.MS_PRIVATE)
    new = _NEW_ROOT
    syscalls.mount("tmpfs", new, "tmpfs", syscalls.MS_NOSUID | syscalls.MS_NODEV,
                   "size=1m,nr_inodes=512,mode=0755")
    for path in plan.dirs:
        target = new + path
        os.makedirs(target, exist_ok=True)
        syscalls.mount(staged.get(path, path), target, None, syscalls.MS_BIND | syscalls.MS_REC)
        syscalls.remount_readonly(target)
    for path in plan.files:
        target = new + path
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "w").close()
        syscalls.mount(path, target, None, syscalls.MS_BIND)
        syscalls.remount_readonly(target)
    for path, dest in plan.symlinks.items():
        os.symlink(dest, new + path)
    for path in plan.hidden:
        syscalls.mount("tmpfs", new + path, "tmpfs",
                       syscalls.MS_RDONLY | syscalls.MS_NOSUID | syscalls.MS_NODEV,
                       "size=4k,nr_inodes=4,mode=0555")
    _build_dev(new + "/dev")
    os.mkdir(new + "/tmp")
    syscalls.mount("tmpfs", new + "/tmp", "tmpfs", syscalls.MS_NOSUID | syscalls.MS_NODEV,
                   f"size={plan.tmp_bytes},nr_inodes={plan.tmp_inodes},mode=1777")
    os.chdir(new)
    syscalls.pivot_root(".", ".")
    syscalls.umount2(".", syscalls.MNT_DETACH)
    os.chdir("/")
    syscalls.mount(None, "/", None,
                   syscalls.MS_REMOUNT | syscalls.MS_BIND | syscalls.MS_RDONLY
                   | syscalls.MS_NOSUID | syscalls.MS_NODEV)
    os.chdir("/tmp")
    syscalls.sethostname("sandbox")


def _build_dev(dev: str) -> None:
    os.mkdir(dev)
    syscalls.mount("tmpfs", dev, "tmpfs", syscalls.MS_NOSUID | syscalls.MS_NOEXEC,
                   "size=64k,nr_inodes=16,mode=0755")
    for name in _DEVICES:
        if os.path.exists("/dev/" + name):
            open(f"{dev}/{name}", "w").close()
            syscalls.mount("/dev/" + name, f"{dev}/{name}", None, syscalls.MS_BIND)
    syscalls.remount_readonly(dev)


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
