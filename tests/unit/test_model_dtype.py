"""`model.dtype: auto`: bf16 only where the device computes it natively."""

from __future__ import annotations

import pytest
import torch

from marl.models.devices import cpu_flags, native_bf16, resolve_dtype
from marl.spec.run import parse_spec

SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
ZEN3 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n"
COOPER_LAKE = "processor\t: 0\nflags\t\t: avx2 avx512f avx512_bf16\n"


def test_cpu_flags_are_the_first_processors() -> None:
    assert "amx_bf16" in cpu_flags(SAPPHIRE_RAPIDS)
    assert cpu_flags("no flags here") == set()


@pytest.mark.parametrize(("cpuinfo", "native"),
                         [(SAPPHIRE_RAPIDS, True), (COOPER_LAKE, True), (ZEN3, False)])
def test_native_bf16_on_cpus(cpuinfo: str, native: bool) -> None:
    assert native_bf16("cpu", cpuinfo) is native


def test_auto_follows_this_machine_and_names_pass_through() -> None:
    want = "bfloat16" if native_bf16("cpu") else "float32"
    assert resolve_dtype("auto", "cpu") == want
    for name in ("float32", "bfloat16", "float16"):
        assert resolve_dtype(name, "cpu") == name


def test_spec_takes_auto_and_defaults_to_float32() -> None:
    assert parse_spec({}).model.dtype == "float32"
    assert parse_spec({"model": {"dtype": "auto"}}).model.dtype == "auto"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_bf16_is_what_torch_says() -> None:
    assert native_bf16("cuda:0") is torch.cuda.is_bf16_supported()
