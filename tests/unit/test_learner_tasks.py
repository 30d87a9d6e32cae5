"""The tasks the learner enqueues carry every spec setting a worker needs."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from marl.problem import Problem
from marl.rollout import AdapterRef
from marl.runtime import streams
from marl.spec.run import parse_spec
from marl.spec.services import LearnerConfig
from services.learner.episodes import Episodes

QUEUE = LearnerConfig().max_queued_tasks


async def _no_cancel() -> None:
    return None


def test_learner_tasks_carry_the_chat_template_settings() -> None:
    spec = parse_spec({"model": {"chat_template_kwargs": {"enable_thinking": False}},
                       "sampling": {"temperature": 0.9, "val_temperature": 0.0}, "seed": 7})
    adapters = {"generator": AdapterRef("run/shared", 3), "aggregator": AdapterRef("run/shared", 3)}
    episodes = Episodes("run", spec, None, "learner-0", lambda: adapters, _no_cancel, QUEUE)  # type: ignore[arg-type]
    problem = Problem(id="p1", prompt="What is 1+1?", answer="2")
    train = episodes.make_task(problem, 4, "train", 2)
    val = episodes.make_task(problem, 4, "val", 0)
    assert train.chat_template_kwargs == {"enable_thinking": False}
    assert train.chat_template == spec.model.chat_template
    assert (train.temperature, val.temperature) == (0.9, 0.0)
    assert train.adapters == adapters and train.seed == 7 and train.sample == 2


async def test_tasks_wait_for_their_push_and_withdrawn_ones_leave_the_stream(
    redis_url: str,
) -> None:
    """A submission made before its adapters are pushed stays in the learner's queue (its
    release time unset) until the push's event is set; one withdrawn when its run ends
    leaves the tasks stream and the learner's books."""
    spec = parse_spec({"workflow": "single", "grpo": {"group_size": 2}})
    r = streams.connect(redis_url)
    adapters = {"generator": AdapterRef("run/shared", 1)}
    episodes = Episodes("run", spec, r, "learner-0", lambda: adapters, _no_cancel, QUEUE)
    try:
        await episodes.open(fresh=True)
        pushed = asyncio.Event()
        problems = [Problem(id=f"p{i}", prompt=f"What is {i}+1?", answer=str(i + 1))
                    for i in range(3)]
        pending = episodes.submit(problems, 1, "train", pushed)
        await episodes.add_tasks()
        assert pending.released is None and await r.xlen(streams.TASKS) == 0
        before = time.monotonic()
        pushed.set()
        await episodes.add_tasks()
        assert pending.released is not None and pending.released >= before
        assert len(pending.ids) == 6 and await r.xlen(streams.TASKS) == 6
        await episodes.withdraw(pending)
        assert await r.xlen(streams.TASKS) == 0
        assert episodes.queue == [] and episodes.expected == {}
    finally:
        await r.aclose()


async def test_a_taken_over_run_drops_the_tasks_its_dead_learner_left_unread(
    redis_url: str,
) -> None:
    """A learner that dies leaves its queued tasks in the stream. Its successor drops the
    ones no worker has read (it queues them again, with its own adapter versions); the ones
    a worker holds stay with it, and another run's tasks are not touched."""
    spec = parse_spec({"workflow": "single", "grpo": {"group_size": 2}})
    r = streams.connect(redis_url)
    adapters = {"generator": AdapterRef("run/shared", 1)}
    problems = [Problem(id=f"p{i}", prompt=f"What is {i}+1?", answer=str(i + 1)) for i in range(3)]
    try:
        for run in ("other", "run"):  # another run's tasks, then the dead learner's
            dead = Episodes(run, spec, r, f"learner-{run}", lambda: adapters, _no_cancel, QUEUE)
            await dead.open(fresh=False)
            dead.submit(problems, 1, "train")
            await dead.add_tasks()
        held = await streams.read_group(r, streams.TASKS, streams.WORKERS_GROUP, "w", count=7)
        assert [e.data["run_id"] for e in held] == ["other"] * 6 + ["run"]

        successor = Episodes("run", spec, r, "learner-1", lambda: adapters, _no_cancel, QUEUE)
        await successor.open(fresh=True)
        left: Any = await r.xrange(streams.TASKS)
        assert [i for i, _ in left] == [e.id for e in held]  # the 5 unread of "run" are gone
        assert await streams.drop_undelivered(
            r, streams.TASKS, streams.WORKERS_GROUP, lambda task: True
        ) == 0
    finally:
        await r.aclose()
