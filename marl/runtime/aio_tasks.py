"""Stopping asyncio background loops when a cancellation can be lost.

A `task.cancel()` can vanish below our code: Python 3.11's `wait_for` (which
redis-py uses for its socket timeouts) returns a result that is ready when the
cancel arrives instead of raising, and redis-py's retries can turn a cancelled
read into a retried command. With redis-py 8.1 and a private Redis, loops of SET/GET
cancelled at a random moment often went on running
(`tests/integration/test_lost_cancel.py` cancels such loops). A loop
that then runs forever (`while True: renew a lease`) kept a finished run from
ever being reported, and a SIGTERMed learner training on. So every loop that is
stopped by cancellation checks `raise_if_cancelled()` each round (the task's
`cancelling()` count survives a lost cancel), and whoever stops such tasks uses
`cancel_until_done`.

The check is in the loops, not in the Redis client after every command: cleanup
in `finally` blocks (releasing a lease, unloading a run's adapters, deleting its
tasks) runs Redis commands after a cancel was delivered, and a client that raised
there would cut that cleanup short after its first command.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

log = logging.getLogger(__name__)

CANCEL_AGAIN_S = 5.0


def raise_if_cancelled() -> None:
    """End the current task's loop if a cancel reached it, lost or not."""
    task = asyncio.current_task()
    if task is not None and task.cancelling() > 0:
        raise asyncio.CancelledError


def log_task_stacks() -> None:
    """Log the stack of every asyncio task of the running loop (services do on SIGUSR2)."""
    tasks = asyncio.all_tasks()
    lines = []
    for task in tasks:
        lines.append(f"{task.get_name()}: {task.get_coro()!r}")
        lines += [
            f"  {f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}"
            for f in task.get_stack(limit=30)
        ]
    log.warning("%d asyncio tasks:\n%s", len(tasks), "\n".join(lines))


async def cancel_until_done(
    tasks: Iterable[asyncio.Task[Any]],
    again_s: float = CANCEL_AGAIN_S,
) -> None:
    """Cancel `tasks` and wait for them, cancelling again every `again_s` seconds while any
    runs on (`again_s` leaves a task's cleanup time to finish). Their exceptions are not
    raised here."""
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=again_s)
        if pending:
            log.warning("%d background loops still run after a cancel; cancelling again",
                        len(pending))
            log_task_stacks()
    await asyncio.gather(*tasks, return_exceptions=True)
