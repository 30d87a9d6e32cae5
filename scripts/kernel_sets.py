"""Print the CPU kernel sets torch can run here other than the one it picks by itself.

torch chooses its vectorised kernels (ATen's CPU capability) by the CPU: AVX-512 where the
CPU has it, else AVX2, else the portable default. `ATEN_CPU_CAPABILITY` can lower the choice,
never raise it. Each set reduces float32 sums in its own order, so a numerics test that holds
on one and fails on another compares against a constant tighter than the kernels reproduce.
`make test` runs on the native set; `make test-kernels` runs the unit tests on each set
printed here.
"""

from __future__ import annotations

import torch

ORDER = ["default", "avx2", "avx512"]


def lower_kernel_sets() -> list[str]:
    native = torch.backends.cpu.get_cpu_capability().lower()
    if native not in ORDER:
        return ["default"] if native != "default" else []
    return ORDER[: ORDER.index(native)]


if __name__ == "__main__":
    print(" ".join(lower_kernel_sets()))
