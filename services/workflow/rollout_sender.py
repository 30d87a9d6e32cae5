"""Finished rollouts to their runs' streams, many in one Redis round trip.

A step's episodes finish together (their turns decode in one batch), so sent one by one
they queue behind each other for the worker's connection, and the learner's last rollout
of a step arrives later than the decode that made it (bench/vs_trl.py's step shows it).
Every rollout finished by the time the previous round trip returns goes in the next one,
a script (`SEND_SCRIPT`) that for each rollout, at once:
- XADDs it to its run's stream only if its task entry is still in the tasks stream: the
  learner deletes the tasks of a run that ended (cancelled, failed) and of a step it has
  gathered, and a rollout of one would stay in its run's stream with nobody to read it;
- XACKs its task entry (a rollout is never sent while its task counts as pending).
A command that fails inside the script fails only its own rollout's `send`, whose task
stays pending (the worker releases it for a retry). Where scripts are refused (an ACL
without EVAL), a MULTI/EXEC of each rollout's XADD and XACK does the same without the
task check (Redis does not roll back the others of a command that fails in it); its XADD
only adds to a stream that exists (NOMKSTREAM), so a rollout finishing after its run
ended does not recreate the stream the learner deleted.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ResponseError

from marl.rollout import Rollout, to_json
from marl.runtime import streams, tracing

log = logging.getLogger(__name__)

SEND_SCRIPT = """
local out = {}
for i = 1, #KEYS - 1 do
  local entry = ARGV[2 * i]
  local result = 'withdrawn'
  if #redis.call('XRANGE', KEYS[1], entry, entry) > 0 then
    local added = redis.pcall('XADD', KEYS[i + 1], '*', 'json', ARGV[2 * i + 1])
    result = type(added) == 'table' and added.err or 'sent'
  end
  if result == 'sent' or result == 'withdrawn' then
    local acked = redis.pcall('XACK', KEYS[1], ARGV[1], entry)
    if type(acked) == 'table' and acked.err then result = acked.err end
  end
  out[i] = result
end
return out
"""
"""KEYS: the tasks stream, then each rollout's run stream; ARGV: the workers' group, then
each rollout's task entry id and JSON. Answers 'sent', 'withdrawn' (its task was gone:
acknowledged, not sent) or the error of a command that failed, per rollout."""

SENT, WITHDRAWN = "sent", "withdrawn"


@dataclass
class _Outgoing:
    stream: str
    payload: str
    """The rollout's JSON, as streams.add writes it."""
    entry_id: str
    sent: asyncio.Future[bool]


class RolloutSender:
    def __init__(self, r: Any):
        self.r = r
        self._queue: list[_Outgoing] = []
        self._flusher: asyncio.Task[None] | None = None
        self._scripts = True
        """False once Redis refused `SEND_SCRIPT`: MULTI/EXEC from then on."""

    async def send(self, rollout: Rollout, entry_id: str) -> bool:
        """XADD `rollout` to its run's stream and XACK its task entry; returns once Redis
        has both: True, or False when the task entry was gone (its run took it back; where
        scripts are refused, when the run's stream was gone: the run ended), so the rollout
        was not sent and the entry only acknowledged. Raises what failed."""
        out = _Outgoing(
            streams.rollouts_stream(rollout.run_id),
            to_json(rollout),
            entry_id,
            asyncio.get_running_loop().create_future(),
        )
        self._queue.append(out)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        return await out.sent

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # the episodes finishing in this loop pass join the first
        while self._queue:
            batch, self._queue = self._queue, []
            try:
                with tracing.span("send rollouts", rollouts=len(batch)):
                    results = await self._send(batch)
            except asyncio.CancelledError:
                for out in [*batch, *self._queue]:
                    out.sent.cancel()
                self._queue = []
                raise
            except Exception as err:
                results = [err] * len(batch)
            for out, result in zip(batch, results, strict=True):
                if out.sent.done():
                    continue
                if isinstance(result, Exception):
                    out.sent.set_exception(result)
                elif result in (SENT, WITHDRAWN):
                    out.sent.set_result(result == SENT)
                else:
                    out.sent.set_exception(ResponseError(result))

    async def _send(self, batch: list[_Outgoing]) -> list[str | Exception]:
        """Each rollout's outcome: SENT, WITHDRAWN, or what failed."""
        if self._scripts:
            args = [x for out in batch for x in (out.entry_id, out.payload)]
            try:
                got: Any = await self.r.eval(
                    SEND_SCRIPT, 1 + len(batch), streams.TASKS, *[o.stream for o in batch],
                    streams.WORKERS_GROUP, *args,
                )
                return [str(x) for x in got]
            except ResponseError as err:
                if not streams.scripts_refused(err):
                    raise
                log.warning("Redis refused the rollout script (%s); sending with MULTI/EXEC "
                            "instead: rollouts of tasks a live run took back will reach its "
                            "stream", err)
                self._scripts = False
        async with self.r.pipeline(transaction=True) as pipe:
            for out in batch:
                pipe.xadd(out.stream, {"json": out.payload}, nomkstream=True)
                pipe.xack(streams.TASKS, streams.WORKERS_GROUP, out.entry_id)
            results = await pipe.execute(raise_on_error=False)
        outcomes: list[str | Exception] = []
        for k in range(len(batch)):
            added, acked = results[2 * k : 2 * k + 2]
            failed = [x for x in (added, acked) if isinstance(x, Exception)]
            if failed:
                outcomes.append(failed[0])
            else:  # no id from XADD: NOMKSTREAM found the run's stream gone
                outcomes.append(SENT if added is not None else WITHDRAWN)
        return outcomes

