"""CPU time of a process tree, from Linux /proc: what the benches' services spend."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def cpu_seconds(roots: Iterable[int]) -> float:
    """CPU time (user + system) of the processes `roots` and all their descendants, living
    and reaped: a reaped child's time is in its parent's cutime/cstime."""
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        pid = int(entry.name)
        children.setdefault(int(fields[1]), []).append(pid)
        ticks[pid] = sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
    total, frontier = 0, [r for r in roots if r in ticks]
    while frontier:
        pid = frontier.pop()
        total += ticks.get(pid, 0)
        frontier += children.get(pid, [])
    return total / os.sysconf("SC_CLK_TCK")
