"""TorchThread: every call, awaited or blocking, runs on its one thread."""

from __future__ import annotations

import asyncio
import threading

import pytest

from marl.local.launcher import service_threads
from marl.runtime.torch_thread import TorchThread


def test_every_call_runs_on_one_thread_other_than_the_callers() -> None:
    worker = TorchThread("test")
    try:
        seen = {worker.call(threading.get_ident)}

        async def many() -> None:
            idents = await asyncio.gather(*(worker.run(threading.get_ident) for _ in range(20)))
            seen.update(idents)

        asyncio.run(many())
        assert len(seen) == 1
        assert seen != {threading.get_ident()}
    finally:
        worker.close()


def test_a_calls_error_reaches_its_caller_and_the_thread_goes_on() -> None:
    worker = TorchThread("test")
    try:
        with pytest.raises(ZeroDivisionError):
            worker.call(lambda: 1 / 0)

        async def after() -> int:
            with pytest.raises(KeyError):
                await worker.run({}.__getitem__, "missing")
            return await worker.run(sum, [1, 2, 3], start=4)

        assert asyncio.run(after()) == 10
    finally:
        worker.close()


@pytest.mark.parametrize(
    ("cores", "overlapped", "inference", "learner"),
    [(2, False, 1, 2), (2, True, 1, 1), (5, True, 2, 3), (1, True, 1, 1), (1, False, 1, 1),
     (8, False, 7, 8)],
)
def test_service_threads_share_cores_out_only_when_overlapped(
    cores: int, overlapped: bool, inference: int, learner: int
) -> None:
    threads = service_threads(cores, overlapped)
    assert (threads["inference"], threads["learner"]) == (inference, learner)
    assert threads["learner_burst"] == max(1, cores)
    assert threads["workflow"] == threads["sandbox"] == 1
