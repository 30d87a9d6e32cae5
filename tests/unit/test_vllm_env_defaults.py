"""The environment the vLLM engine sets before its engine core starts."""

from __future__ import annotations

import os

import pytest
import torch

from services.inference.vllm_engine import _cpu_env_defaults, _gpu_env_defaults, bound_cpus

VAR = "VLLM_WORKER_MULTIPROC_METHOD"


def unset(monkeypatch: pytest.MonkeyPatch, var: str = VAR) -> None:
    """`var` absent for the test and as it was afterwards (a bare delenv of an absent
    variable records nothing to undo, so what the test sets would outlive it)."""
    monkeypatch.setenv(var, "")
    monkeypatch.delenv(var)


def test_on_a_gpu_the_engine_core_is_spawned(monkeypatch: pytest.MonkeyPatch) -> None:
    unset(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    _gpu_env_defaults()
    assert os.environ[VAR] == "spawn"


def test_a_method_the_user_chose_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VAR, "fork")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    _gpu_env_defaults()
    assert os.environ[VAR] == "fork"


def test_without_a_gpu_vllm_keeps_its_own_default(monkeypatch: pytest.MonkeyPatch) -> None:
    unset(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _gpu_env_defaults()
    assert VAR not in os.environ


@pytest.mark.parametrize(
    ("allowed", "omp_threads", "bound"),
    [
        ([0, 1], "1", [1]),  # a synchronous replica's share of 2 cores
        ([0, 1, 2, 3], "2", [2, 3]),
        ([0, 1], "2", [0, 1]),
        ([0, 1], "8", [0, 1]),  # more threads than cores: every core
        ([0, 1], None, [0, 1]),  # a replica with its machine to itself
        ([0, 1], "", [0, 1]),
        ([0, 1], "0", [0, 1]),
        ([0, 1], "two", [0, 1]),
    ],
)
def test_vllm_cpu_threads_bind_the_replicas_share(
    allowed: list[int], omp_threads: str | None, bound: list[int]
) -> None:
    assert bound_cpus(allowed, omp_threads) == bound


CPU_VARS = (
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_CPU_NUM_OF_RESERVED_CPU",
    "VLLM_CPU_KVCACHE_SPACE",
    "HF_HUB_OFFLINE",
)
"""The variables `_cpu_env_defaults` sets."""


@pytest.fixture
def cpu_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for var in CPU_VARS:
        unset(monkeypatch, var)
    return monkeypatch


def test_the_cpu_binding_follows_omp_num_threads(cpu_env: pytest.MonkeyPatch) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    cpu_env.setenv("OMP_NUM_THREADS", "1")
    _cpu_env_defaults()
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == str(allowed[-1])


def test_a_binding_the_user_chose_is_kept(cpu_env: pytest.MonkeyPatch) -> None:
    cpu_env.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    cpu_env.setenv("OMP_NUM_THREADS", "1")
    _cpu_env_defaults()
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
