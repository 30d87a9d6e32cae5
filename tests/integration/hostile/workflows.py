"""Workflows that import fine and misbehave once called."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from pydantic import BaseModel, field_validator

from marl.workflows import Workflow


class ExitingArgs(BaseModel):
    """`workflow_args` whose validator ends the interpreter."""

    x: int = 0

    @field_validator("x")
    @classmethod
    def _exit(cls, value: int) -> int:
        sys.exit(4)


async def _noop(episode: Any, problem: Any) -> str:
    return ""


async def _exit_in_a_gathered_coroutine(episode: Any, problem: Any) -> str:
    async def slot() -> str:
        await asyncio.sleep(0)
        raise SystemExit(5)

    answers = await asyncio.gather(slot(), slot())
    return answers[0]


EXITS_VALIDATING_ARGS = Workflow(name="exits_validating_args", roles=("generator",),
                                 run=_noop, args=ExitingArgs)
EXITS_IN_GATHER = Workflow(name="exits_in_gather", roles=("generator",),
                           run=_exit_in_a_gathered_coroutine)
