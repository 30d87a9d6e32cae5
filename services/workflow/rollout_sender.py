"""Finished rollouts to their runs' streams, many in one Redis round trip.

A step's episodes finish together (their turns decode in one batch), so sent one by one
they queue behind each other for the worker's connection: measured on bench/vs_trl.py's
Single step (128 episodes, 2 cores), the learner got the last rollout ~80 ms after the
decode ended, ~40 ms once they were sent together and scored without a thread trip. Here each rollout's XADD and its task's XACK still go in one MULTI/EXEC
(a rollout is never sent while its task counts as pending), and every rollout finished
by the time the previous transaction returns goes in the next one. A command that fails
inside the transaction (Redis does not roll the others back) fails only its own
rollout's `send`.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from marl import streams, trace
from marl.rollout import Rollout


@dataclass
class _Outgoing:
    stream: str
    payload: dict[str, str]
    entry_id: str
    sent: asyncio.Future[None]


class RolloutSender:
    def __init__(self, r: Any):
        self.r = r
        self._queue: list[_Outgoing] = []
        self._flusher: asyncio.Task[None] | None = None

    async def send(self, rollout: Rollout, entry_id: str) -> None:
        """XADD `rollout` to its run's stream and XACK its task entry; returns once Redis
        has both, raises what the transaction raised."""
        out = _Outgoing(
            streams.rollouts_stream(rollout.run_id),
            {"json": json.dumps(rollout.to_dict())},  # as streams.add writes it
            entry_id,
            asyncio.get_running_loop().create_future(),
        )
        self._queue.append(out)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        await out.sent

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # the episodes finishing in this loop pass join the first
        while self._queue:
            batch, self._queue = self._queue, []
            try:
                with trace.span("send rollouts", rollouts=len(batch)):
                    async with self.r.pipeline(transaction=True) as pipe:
                        for out in batch:
                            pipe.xadd(out.stream, out.payload)
                            pipe.xack(streams.TASKS, streams.WORKERS_GROUP, out.entry_id)
                        results = await pipe.execute(raise_on_error=False)
            except asyncio.CancelledError:
                for out in [*batch, *self._queue]:
                    out.sent.cancel()
                self._queue = []
                raise
            except Exception as err:
                results = [err, err] * len(batch)
            for k, out in enumerate(batch):
                failed = [x for x in results[2 * k : 2 * k + 2] if isinstance(x, Exception)]
                if out.sent.done():
                    continue
                if failed:
                    out.sent.set_exception(failed[0])
                else:
                    out.sent.set_result(None)
