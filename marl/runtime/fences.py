"""Fencing tokens of run leases: what lets the stores a learner writes to refuse a learner
that lost its run.

A learner trains a run only while it holds the run's lease (services/learner/runs.py).
Each time a lease is taken, the run's record in Redis counts one more in its `fence`
field (HINCRBY, in the same MULTI/EXEC that takes the lease), and the taker keeps that
number. A learner that stalled past its lease (a long GC pause, a frozen VM, a partition)
may wake and write before it learns it lost the run; its token is then below the run's
current one, so:

- an inference replica refuses its pushes (`PushFences`: below the newest token the
  replica saw for that run, or below the run's current token in Redis);
- its checkpoint is refused before `latest` moves (the token written beside the run's
  checkpoints is higher: services/learner/checkpoint.py).

An adapter name belongs to its run: `<run_id>/<policy>` (`run_of_adapter`).
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

FIELD = "fence"
"""The field of a run's record that holds its newest fencing token."""


def run_record_key(run_id: str) -> str:
    """The hash that is a run's record (services/learner/runs.py: `run_key`)."""
    return f"marl:run:{run_id}"


def run_of_adapter(name: str) -> str:
    """The run an adapter name belongs to: its part before the first `/` (run ids never
    hold one)."""
    return name.split("/", 1)[0]


async def current(r: aioredis.Redis, run_id: str) -> int:
    """The run's newest fencing token; 0 for a run no learner ever leased (or none)."""
    value: Any = await r.hget(run_record_key(run_id), FIELD)
    return int(value or 0)


class StaleFence(Exception):
    """A write carried a fencing token below the run's newest: its learner lost the run."""


class PushFences:
    """The newest fencing token an inference replica saw pushed for each run."""

    MAX_RUNS = 65_536
    """Runs remembered; past it the oldest-seen are forgotten (Redis still holds theirs)."""

    def __init__(self) -> None:
        self._newest: dict[str, int] = {}

    def newest(self, run_id: str) -> int:
        """The newest token seen pushed for the run; 0 before any."""
        return self._newest.get(run_id, 0)

    def check(self, run_id: str, fence: int, current_in_redis: int | None) -> None:
        """Raise StaleFence when `fence` is below the newest seen for `run_id` or below
        the run's current token in Redis (None: this replica has no Redis); else it is the
        newest seen."""
        newest = max(self._newest.get(run_id, 0), current_in_redis or 0)
        if fence < newest:
            raise StaleFence(
                f"run {run_id}: fencing token {fence} is stale (the run's newest is {newest}): "
                "another learner holds the run's lease now"
            )
        if current_in_redis is not None and fence > current_in_redis:
            raise StaleFence(
                f"run {run_id}: fencing token {fence} was never issued (the run's newest is "
                f"{current_in_redis})"
            )
        self._newest.pop(run_id, None)
        self._newest[run_id] = fence
        while len(self._newest) > self.MAX_RUNS:
            del self._newest[next(iter(self._newest))]
