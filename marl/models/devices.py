"""Where a service's torch work runs (`auto`, `cpu` or `cuda`) and in which dtype
(`model.dtype: auto`), resolved on this machine."""

from __future__ import annotations

from pathlib import Path

import torch

NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
"""/proc/cpuinfo flags of x86 CPUs whose instructions compute in bf16 (torch's oneDNN
matmuls use them); without one, a bf16 matmul is emulated and slower than float32."""


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The first processor's flags in /proc/cpuinfo (or `cpuinfo`); empty where unreadable."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.partition(":")[2].split())
    return set()


def native_bf16(device: str, cpuinfo: str | None = None) -> bool:
    """Whether `device` (a resolved one: `cpu`, `cuda:N`) computes bf16 natively."""
    if device.startswith("cuda"):
        return bool(torch.cuda.is_bf16_supported())
    return any(flag in cpu_flags(cpuinfo) for flag in NATIVE_BF16_CPU_FLAGS)


def resolve_dtype(name: str, device: str) -> str:
    """`model.dtype` for a process on `device` (resolved): `auto` is bfloat16 where the
    device computes it natively, float32 elsewhere; any other name as it is."""
    if name != "auto":
        return name
    return "bfloat16" if native_bf16(device) else "float32"


def resolve_device(name: str, rank: int = 0, field: str = "learner.device") -> str:
    """`name` for one process: `auto` is CUDA when torch sees a GPU; rank r of a group
    takes GPU r. `field` is the setting named in the error a user sees."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"{field}=cuda but torch sees no GPU (torch.cuda.is_available() is "
                f"False); use {field}=cpu or auto"
            )
        if rank >= torch.cuda.device_count():
            raise ValueError(
                f"learner.world_size asks for GPU {rank}, but this machine has "
                f"{torch.cuda.device_count()}; lower learner.world_size"
            )
        return f"cuda:{rank}"
    return "cpu"
