"""`sleep_when_idle` on a stand-in for vLLM's `shm_broadcast` (the real one is checked by
tests/integration/test_engine_contract.py: test_an_idle_vllm_engine_stays_off_the_cores and
test_a_vllm_worker_that_sleeps_when_idle_never_waits_out_a_missed_wakeup)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from services.inference.vllm_idle import READER_SPIN_S, sleep_when_idle


def fresh_module() -> SimpleNamespace:
    """A module with a `SpinCondition` whose constructor is vLLM 0.32's."""

    class SpinCondition:
        def __init__(
            self, is_reader: bool, context: Any, notify_address: str, busy_loop_s: float = 1
        ):
            self.busy_loop_s = busy_loop_s

    return SimpleNamespace(SpinCondition=SpinCondition)


def test_readers_default_to_a_short_spin() -> None:
    module = fresh_module()
    assert sleep_when_idle(module)
    assert READER_SPIN_S == 0.05
    assert module.SpinCondition(True, None, "ipc://x").busy_loop_s == 0.05


def test_a_spin_time_given_by_vllm_is_kept() -> None:
    module = fresh_module()
    sleep_when_idle(module)
    assert module.SpinCondition(True, None, "ipc://x", busy_loop_s=2).busy_loop_s == 2
    assert module.SpinCondition(True, None, "ipc://x", 3).busy_loop_s == 3


def test_applying_twice_wraps_once() -> None:
    module = fresh_module()
    assert sleep_when_idle(module)
    once = module.SpinCondition.__init__
    assert sleep_when_idle(module)
    assert module.SpinCondition.__init__ is once


def test_a_vllm_without_the_spin_argument_is_left_alone() -> None:
    class Other:
        def __init__(self, is_reader: bool) -> None:
            self.is_reader = is_reader

    module = SimpleNamespace(SpinCondition=Other)
    init = Other.__init__
    assert not sleep_when_idle(module)
    assert Other.__init__ is init
    assert not sleep_when_idle(SimpleNamespace())
