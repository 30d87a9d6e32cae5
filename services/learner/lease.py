"""A learner's hold on one run: kept alive in the background, checked before every write
that another learner of the run could also make.

The lease (services/learner/runs.py) is renewed every `LEASE_S / 3` by one
compare-and-set; a renewal that finds the lease gone or someone else's marks it lost.
Renewal alone cannot stop a learner that stalled (a GC pause, a frozen VM) from
writing when it wakes, before its renewal loop runs again, so each push and checkpoint
first asks Redis whether the lease is still this learner's (`check`), and carries the
lease's fencing token (`fence`), which the inference replicas and the checkpoint
directory check against the newest one: a write that slips between the check and
the takeover is refused there (marl.runtime.fences).

A learner that lost a run's lease stops the run (`LeaseLost`) at once, whatever it was
doing (services/learner/server.py: `train_run` cancels it), and leaves its state alone: the run's record, its adapters on the replicas and its streams are the new
holder's.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from marl.runtime.aio_tasks import raise_if_cancelled
from services.learner.runs import LEASE_S, RunStore

log = logging.getLogger(__name__)


class LeaseLost(Exception):
    """This learner no longer holds the run's lease: another learner took the run over
    (or will, from its last checkpoint), so this one stops it without recording an end."""


@dataclass
class Lease:
    store: RunStore
    run_id: str
    holder: str
    """The lease's value while this learner holds it (`RunStore.claim`)."""
    fence: int
    """The lease's fencing token: pushes and checkpoints carry it."""
    lost: str | None = None
    """Why the lease was lost, once it was."""
    _lost_event: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def lost_to(self, why: str) -> LeaseLost:
        """Mark the lease lost (for `why`, the first time) and the LeaseLost to raise."""
        if self.lost is None:
            self.lost = why
            self._lost_event.set()
            log.error("run %s: %s; this learner stops the run", self.run_id, why)
        return LeaseLost(f"run {self.run_id}: {self.lost}")

    async def wait_lost(self) -> None:
        """Return once the lease is found lost."""
        await self._lost_event.wait()

    def check_local(self) -> None:
        """Raise LeaseLost if the renewal loop already found the lease lost."""
        if self.lost is not None:
            raise self.lost_to(self.lost)

    async def check(self) -> None:
        """Raise LeaseLost unless Redis says the lease is this learner's now: before a
        push or a checkpoint."""
        self.check_local()
        if not await self.store.holds(self.run_id, self.holder):
            raise self.lost_to(f"lost the lease (fencing token {self.fence}) to another learner")

    async def keep(self) -> None:
        """Renew the lease until cancelled or lost; a Redis that does not answer is
        retried (a lease that lapses meanwhile is lost at the next renewal)."""
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import TimeoutError as RedisTimeoutError

        while self.lost is None:
            await asyncio.sleep(LEASE_S / 3)
            raise_if_cancelled()  # a cancel that redis-py lost in the last renew (see aio_tasks)
            try:
                renewed = await self.store.renew(self.run_id, self.holder)
            except (RedisConnectionError, RedisTimeoutError) as err:  # a restarting Redis
                log.warning("could not renew the lease of run %s: %s; retrying", self.run_id, err)
                continue
            if not renewed:
                self.lost_to(f"lost the lease (fencing token {self.fence}) to another learner")
