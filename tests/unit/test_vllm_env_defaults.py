"""The environment the vLLM engine sets before its engine core starts."""

from __future__ import annotations

import os

import pytest
import torch

from services.inference.vllm_engine import _gpu_env_defaults

VAR = "VLLM_WORKER_MULTIPROC_METHOD"


def unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """VAR absent for the test and as it was afterwards (a bare delenv of an absent
    variable records nothing to undo, so what the test sets would outlive it)."""
    monkeypatch.setenv(VAR, "")
    monkeypatch.delenv(VAR)


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
