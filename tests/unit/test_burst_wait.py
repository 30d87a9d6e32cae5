"""How long an idle transformers engine waits for the rest of a burst of requests."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.inference.transformers_engine import CLIENT_HEARD_S, burst_wait_s, every_client_in

PAUSE, MAX_WAIT, MAX_BATCH = 0.005, 0.05, 256


def wait(first: float, newest: float, now: float, waiting: int = 64) -> float:
    return burst_wait_s(first, newest, now, waiting, MAX_BATCH, PAUSE, MAX_WAIT)


def test_the_pause_counts_from_the_newest_request() -> None:
    # a worker's 64 requests at 0, the other worker's at 1.5 ms: start at 6.5 ms
    assert wait(0.0, 0.0015, 0.0015, 128) == pytest.approx(0.005)
    assert wait(0.0, 0.0015, 0.005, 128) == pytest.approx(0.0015)
    assert wait(0.0, 0.0015, 0.0066, 128) == 0.0
    assert wait(0.0, 0.0015, 0.010, 128) == 0.0


def test_a_burst_that_keeps_coming_starts_once_the_first_has_waited_long_enough() -> None:
    assert wait(0.0, 0.048, 0.048) == pytest.approx(0.002)
    assert wait(0.0, 0.0499, 0.05) == 0.0


def test_a_full_batch_starts_at_once() -> None:
    assert wait(0.0, 0.0, 0.0, waiting=MAX_BATCH) == 0.0
    assert wait(0.0, 0.0, 0.0, waiting=MAX_BATCH - 1) == pytest.approx(PAUSE)


def test_beside_a_running_batch_newcomers_join_once_as_many_as_its_rows() -> None:
    rows = 8
    assert burst_wait_s(0.0, 0.0, 0.0, rows - 1, rows, PAUSE, MAX_WAIT) == pytest.approx(PAUSE)
    assert burst_wait_s(0.0, 0.0, 0.0, rows, rows, PAUSE, MAX_WAIT) == 0.0


def test_an_idle_engine_waits_for_no_one_once_every_client_heard_from_has_sent() -> None:
    heard = {"worker-a": 0.0, "worker-b": 0.5}
    assert not every_client_in(heard, {"worker-a"}, 1.0)  # b's burst may be on its way
    assert every_client_in(heard, {"worker-a", "worker-b"}, 1.0)
    assert every_client_in(heard, {"worker-a", "worker-b", ""}, 1.0)  # and a unary one


def test_a_client_not_heard_from_lately_is_forgotten() -> None:
    heard = {"worker-a": 20.0, "worker-gone": 20.0 - CLIENT_HEARD_S}
    assert every_client_in(heard, {"worker-a"}, 20.0)
    assert heard == {"worker-a": 20.0}


def test_requests_of_no_client_heard_from_wait_for_the_pause() -> None:
    assert not every_client_in({}, {""}, 0.0)  # unary calls only: the pause decides


@pytest.mark.parametrize("client", ["ipv4:127.0.0.1:50000", ""])
def test_a_worker_burst_is_prefilled_without_the_pause(client: str) -> None:
    """One worker's GenerateMany is its whole burst: the engine, which has heard from no
    one else, starts it at once. Requests of no client wait for the pause (3 s here)."""
    from marl.models.demo import demo_model_dir
    from marl.spec.services import InferenceConfig
    from services.inference.engine import GenerationRequest
    from services.inference.transformers_engine import BASE, TransformersEngine

    pause = 3.0
    engine = TransformersEngine(InferenceConfig(model=str(demo_model_dir())),
                                batch_wait_s=pause, max_batch_wait_s=2 * pause)

    async def run() -> float:
        reqs = [GenerationRequest([5, 6], BASE, max_tokens=3, seed=i + 1, client=client)
                for i in range(4)]
        started = time.monotonic()
        try:
            await asyncio.gather(*(engine.generate(r) for r in reqs))
            return time.monotonic() - started
        finally:
            await engine.close()

    took = asyncio.run(run())
    assert (took < pause) if client else (took >= pause)
