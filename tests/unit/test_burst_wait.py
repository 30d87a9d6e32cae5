"""How long an idle transformers engine waits for the rest of a burst of requests."""

from __future__ import annotations

import pytest

from services.inference.transformers_engine import burst_wait_s

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
