"""A service stops on SIGTERM even when a background loop loses its first cancellation."""

from __future__ import annotations

import asyncio

from marl.runtime.aio_tasks import cancel_until_done


def test_a_lost_cancellation_is_repeated() -> None:
    steps: list[int] = []

    async def loop_that_loses_one_cancel() -> None:
        lost = False
        while True:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if lost:
                    raise
                lost = True  # what a library that swallows a cancel does
            steps.append(1)

    async def main() -> float:
        task = asyncio.create_task(loop_that_loses_one_cancel())
        await asyncio.sleep(0.05)
        started = asyncio.get_running_loop().time()
        await cancel_until_done([task], again_s=0.2)
        assert task.cancelled()
        return asyncio.get_running_loop().time() - started

    took = asyncio.run(main())
    assert 0.2 <= took < 1.0
    assert steps  # it kept running after the first cancel, as the learner did


def test_loops_that_end_at_the_first_cancel_are_not_waited_on() -> None:
    async def main() -> float:
        tasks = [asyncio.create_task(asyncio.sleep(60)) for _ in range(3)]
        await asyncio.sleep(0)
        started = asyncio.get_running_loop().time()
        await cancel_until_done(tasks, again_s=5.0)
        assert all(t.cancelled() for t in tasks)
        return asyncio.get_running_loop().time() - started

    assert asyncio.run(main()) < 1.0
