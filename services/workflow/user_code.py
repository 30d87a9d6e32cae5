"""The run's code on a worker (its workflow, reward function, tools): whatever it raises
fails its episode, never the worker.

A workflow may raise anything, `SystemExit` (a `sys.exit` somewhere) and
`KeyboardInterrupt` included. asyncio treats those two apart: raised inside any task,
they leave the task and stop the event loop (`Task.__step` re-raises them), so one
episode whose workflow gathers a coroutine that calls `sys.exit` would end the worker and
every episode in it. `EpisodeRunner.run` marks the episode's context as running user
code (`running_user_code`) and turns what its own task gets into `UserCodeExit`;
`task_factory`, the worker loop's task factory, does the same inside every task created
in such a context (the coroutines a workflow gathers). The worker's own tasks are left
as they are: it stops on signals through the loop's handlers, never by raising these.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from typing import Any

from marl.workflows.base import EpisodeError

_USER_CODE: contextvars.ContextVar[bool] = contextvars.ContextVar("marl_user_code",
                                                                 default=False)


class UserCodeExit(EpisodeError):
    """The run's code raised SystemExit or KeyboardInterrupt: its episode fails."""


def exit_error(err: BaseException) -> UserCodeExit:
    return UserCodeExit(f"the run's code raised {type(err).__name__}({err}); an episode's "
                        "code must not exit the worker")


@contextmanager
def running_user_code() -> Iterator[None]:
    """Tasks created within (and in their tasks, on down) are `task_factory`'s to guard."""
    token = _USER_CODE.set(True)
    try:
        yield
    finally:
        _USER_CODE.reset(token)


async def _contained(coro: Awaitable[Any]) -> Any:
    try:
        return await coro
    except (SystemExit, KeyboardInterrupt) as err:
        raise exit_error(err) from None


def task_factory(loop: asyncio.AbstractEventLoop, coro: Any,
                 context: contextvars.Context | None = None) -> asyncio.Task[Any]:
    """asyncio's Task, its coroutine guarded when it is created running user code."""
    user = (context.get(_USER_CODE, False) if context is not None else _USER_CODE.get())
    return asyncio.Task(_contained(coro) if user else coro, loop=loop, context=context)
