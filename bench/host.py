"""The host a bench ran on, printed with its figures and kept in its JSON.

This project's VM has run on hosts whose CPUs differ: on one with AVX2 but neither
AVX-512 nor native bf16, a bare `python -c` loop ran at half speed and TRL's bf16 step
~9x slower than elsewhere. A figure compares only with one from the same kind of host.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
"""The CPU flags that decide the speed of the benches' matmuls."""


def host(cpuinfo: str | None = None) -> dict[str, Any]:
    """The CPU (the first processor of /proc/cpuinfo, or of `cpuinfo`), the cores this
    process may run on (what `taskset` leaves it, not the machine's), and which of FLAGS
    the CPU has."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    first: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip() and first:
            break
        key, _, value = line.partition(":")
        first.setdefault(key.strip(), value.strip())
    flags = set(first.get("flags", "").split())
    return {
        "cpu": first.get("model name", "unknown"),
        "cpu_family": first.get("cpu family", "?"),
        "cpu_model": first.get("model", "?"),
        "cores": len(os.sched_getaffinity(0)),
        "flags": [f for f in FLAGS if f in flags],
    }


def describe(facts: dict[str, Any]) -> str:
    flags = ", ".join(facts["flags"]) or f"none of {', '.join(FLAGS)}"
    return (f"host: {facts['cpu']} (family {facts['cpu_family']} model {facts['cpu_model']}), "
            f"{facts['cores']} cores, {flags}")
