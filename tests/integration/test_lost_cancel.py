"""Loops stopped by cancellation end even when redis-py loses the cancel.

CI once hung for 9 minutes after a run's last step: the learner's lease loop was
cancelled while it renewed the lease, redis-py finished the command instead of
raising, and `while True` went on renewing; the run was never reported done.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from marl.runtime import streams
from marl.runtime.aio_tasks import raise_if_cancelled
from services.learner import lease as learner_lease


def test_a_redis_loop_ends_at_every_cancel(redis_url: str) -> None:
    """500 cancels at random moments of a loop of real Redis commands: each loop ends within
    a second of its one cancel (without `raise_if_cancelled`, 196 of 300 ran on here)."""

    async def main() -> int:
        r = streams.connect(redis_url)
        rounds = 0
        abandoned = False

        async def loop() -> None:
            nonlocal rounds
            while not abandoned:
                await r.set("marl:test:k", "v")
                await r.get("marl:test:k")
                rounds += 1
                raise_if_cancelled()

        ran_on = 0  # loops that ran on after their cancel: the first ends the test
        try:
            for _ in range(500):
                task = asyncio.create_task(loop())
                await asyncio.sleep(random.random() * 0.003)
                task.cancel()
                done, _ = await asyncio.wait({task}, timeout=1.0)
                if not done:
                    ran_on += 1
                    abandoned = True
                    await asyncio.gather(task, return_exceptions=True)
                    break
        finally:
            await r.aclose()
        assert rounds > 0
        return ran_on

    assert asyncio.run(main()) == 0


class SwallowingStore:
    """A run store whose renew, like redis-py at times, completes instead of raising when
    cancelled."""

    def __init__(self) -> None:
        self.renewing = asyncio.Event()
        self.renewals = 0

    async def renew(self, run_id: str, learner_id: str) -> bool:
        self.renewals += 1
        self.renewing.set()
        try:
            await asyncio.sleep(0.2)
        except asyncio.CancelledError:
            pass
        return True


def test_the_lease_loop_ends_when_its_cancel_is_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(learner_lease, "LEASE_S", 0.03)

    async def main() -> Any:
        store = SwallowingStore()
        held = learner_lease.Lease(store, "run", "learner:1", 1)  # type: ignore[arg-type]
        lease = asyncio.create_task(held.keep())
        await store.renewing.wait()
        lease.cancel()
        done, _ = await asyncio.wait({lease}, timeout=1.0)
        renewals = store.renewals
        while not lease.done():  # stop a loop that ran on (a cancel that lands in its sleep)
            lease.cancel()
            await asyncio.sleep(0.01)
        assert done, f"the lease loop ran on after its cancel ({renewals} renewals)"
        return lease

    assert asyncio.run(main()).cancelled()
