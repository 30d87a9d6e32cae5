"""Delivery against a real redis-server: heartbeats decide who is dead, a dead worker's
entries move within seconds while a slow live worker keeps its own, failing entries are
retried and then dead-lettered (and their run told), and a vanished group is recreated."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from typing import Any

import pytest

from marl.models.demo import demo_model_dir
from marl.problem import Problem
from marl.rollout import AdapterRef, Rollout, Task
from marl.runtime import replicas, streams
from marl.spec.run import RunSpec
from marl.spec.services import LearnerConfig, WorkflowConfig
from services.workflow import worker
from tests.support.tasks import a_task, answered
from tests.support.worker_loop import working


async def test_dead_consumer_entries_are_claimed_and_a_live_ones_are_kept(redis_url: str) -> None:
    r = streams.connect(redis_url)
    try:
        await streams.ensure_group(r, "s", "g")
        for i in range(4):
            await streams.add(r, "s", {"i": i})
        await streams.beat(r, "slow", ttl_s=30)
        await streams.beat(r, "doomed", ttl_s=0.5)
        assert len(await streams.read_group(r, "s", "g", "slow", count=2, block_ms=10)) == 2
        assert len(await streams.read_group(r, "s", "g", "doomed", count=2, block_ms=10)) == 2
        await asyncio.sleep(0.3)
        # both alive: nothing moves, however idle their entries
        assert await streams.claim_dead(r, "s", "g", "rescuer", min_idle_ms=100, max_deliveries=5) == []
        await asyncio.sleep(0.4)  # doomed's key expired: it is dead
        t0 = time.monotonic()
        got = await streams.claim_dead(r, "s", "g", "rescuer", min_idle_ms=100, max_deliveries=5)
        assert time.monotonic() - t0 < 1.0
        assert sorted(e.data["i"] for e in got) == [2, 3]
        assert all(e.deliveries == 2 for e in got)
        # a second claimer finds them fresh (XCLAIM reset their idle time): no double claim
        assert await streams.claim_dead(r, "s", "g", "other", min_idle_ms=100, max_deliveries=5) == []
        summary = await r.xpending("s", "g")
        owners = {c["name"]: int(c["pending"]) for c in summary["consumers"]}
        assert owners == {"slow": 2, "rescuer": 2}
    finally:
        await r.aclose()


async def test_released_entry_is_retried_then_dead_lettered(redis_url: str) -> None:
    r = streams.connect(redis_url)
    told: list[streams.Entry] = []

    async def on_dead(entry: streams.Entry) -> None:
        told.append(entry)

    try:
        await streams.ensure_group(r, "s", "g")
        await streams.add(r, "s", {"i": 7})
        await streams.beat(r, "w", ttl_s=30)
        (entry,) = await streams.read_group(r, "s", "g", "w", block_ms=10)
        deliveries = [entry.deliveries]
        for _ in range(5):
            await streams.release(r, "s", "g", entry.id)  # the handler failed
            # not at once: a released entry waits min_idle_ms before its retry
            assert await streams.claim_dead(r, "s", "g", "w", min_idle_ms=200, max_deliveries=5) == []
            await asyncio.sleep(0.25)
            got = await streams.claim_dead(
                r, "s", "g", "w", min_idle_ms=200, max_deliveries=3, on_dead=on_dead
            )
            if not got:
                break
            deliveries.append(got[0].deliveries)
        assert deliveries == [1, 2, 3]
        assert [e.data for e in told] == [{"i": 7}]
        dead: Any = await r.xrange(streams.dead_letter_stream("s"))
        assert len(dead) == 1 and dead[0][1]["deliveries"] == "4"
        assert (await r.xpending("s", "g"))["pending"] == 0
    finally:
        await r.aclose()


async def test_a_deleted_pending_entry_is_acknowledged_not_claimed_forever(
    redis_url: str,
) -> None:
    r = streams.connect(redis_url)
    try:
        await streams.ensure_group(r, "s", "g")
        entry_id = await streams.add(r, "s", {"i": 1})
        await streams.read_group(r, "s", "g", "gone", block_ms=10)
        await r.xdel("s", entry_id)
        await asyncio.sleep(0.05)
        assert await streams.claim_dead(r, "s", "g", "w", min_idle_ms=10, max_deliveries=5) == []
        assert (await r.xpending("s", "g"))["pending"] == 0
    finally:
        await r.aclose()


async def test_a_vanished_group_is_recreated_not_a_crash(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    r = streams.connect(redis_url)
    try:
        await streams.ensure_group(r, "s", "g")
        await r.delete("s")  # a Redis restarted without its data
        assert await streams.read_group(r, "s", "g", "c", block_ms=10) == []
        assert "recreated" in caplog.text
        await streams.add(r, "s", {"i": 1})
        assert [e.data for e in await streams.read_group(r, "s", "g", "c", block_ms=10)] == [
            {"i": 1}
        ]
    finally:
        await r.aclose()


async def test_forget_dead_consumers_keeps_live_and_holding_ones(redis_url: str) -> None:
    r = streams.connect(redis_url)
    try:
        await streams.ensure_group(r, "s", "g")
        for i in range(3):
            await streams.add(r, "s", {"i": i})
        await streams.read_group(r, "s", "g", "holder", count=1, block_ms=10)
        await streams.beat(r, "empty-live", ttl_s=30)
        for name in ("empty-dead", "empty-live"):  # each took one entry and finished it
            (e,) = await streams.read_group(r, "s", "g", name, count=1, block_ms=10)
            await streams.ack(r, "s", "g", e.id)
        await asyncio.sleep(0.05)
        assert await streams.forget_dead_consumers(r, "s", "g", min_idle_ms=10) == 1
        names = {c["name"] for c in await r.xinfo_consumers("s", "g")}
        assert names == {"holder", "empty-live"}
    finally:
        await r.aclose()


class FailingRunner(worker.EpisodeRunner):
    """A worker whose every episode hits a bug."""

    def __init__(self, redis: object, worker_id: str):
        super().__init__(redis, worker_id, replica_wait_s=0, judge_endpoints=())
        self.attempts = 0

    async def run(self, task: Task) -> Rollout:
        self.attempts += 1
        raise RuntimeError("a bug in marl")


async def test_a_task_that_keeps_failing_reaches_its_run_as_dead_lettered(
    redis_url: str,
) -> None:
    r = streams.connect(redis_url)
    task = a_task()
    await streams.ensure_group(r, streams.TASKS, streams.WORKERS_GROUP)
    await streams.ensure_group(r, streams.rollouts_stream("run-1"), "learner")
    await streams.add(r, streams.TASKS, task.to_dict())
    runner = FailingRunner(r, "w1")
    try:
        async with working(runner, max_deliveries=3):
            deadline = time.monotonic() + 20
            got: list[streams.Entry] = []
            while not got:
                assert time.monotonic() < deadline, "no dead-lettered rollout arrived"
                got = await streams.read_group(
                    r, streams.rollouts_stream("run-1"), "learner", "l", block_ms=200
                )
            rollout = Rollout.from_dict(got[0].data)
            assert rollout.task_id == task.id
            assert rollout.error == f"{streams.DEAD_LETTERED} after 4 deliveries"
            assert runner.attempts == 3
            assert await r.xlen(streams.dead_letter_stream(streams.TASKS)) == 1
    finally:
        await r.aclose()


async def test_a_worker_importing_its_tokenizer_library_beats_and_takes_no_task(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The import runs in a thread: the heartbeat outlives its TTL meanwhile, and the
    stream's tasks stay unread for other workers until the worker can start them."""
    importing, imported = threading.Event(), threading.Event()

    def slow_import() -> None:
        importing.set()
        imported.wait(10)

    monkeypatch.setattr(worker, "import_tokenizers", slow_import)
    r = streams.connect(redis_url)
    task = a_task()
    await streams.ensure_group(r, streams.TASKS, streams.WORKERS_GROUP)
    await streams.add(r, streams.TASKS, task.to_dict())
    runner = FailingRunner(r, "w1")
    loop = asyncio.create_task(
        worker.work_loop(runner, WorkflowConfig(concurrency=4, heartbeat_ttl_s=0.5))
    )
    try:
        assert await asyncio.to_thread(importing.wait, 10)
        await asyncio.sleep(1.5)  # three TTLs
        assert await r.exists(streams.alive_key("w1"))
        assert (await r.xpending(streams.TASKS, streams.WORKERS_GROUP))["pending"] == 0
        imported.set()
        deadline = time.monotonic() + 10
        while runner.attempts == 0:
            assert time.monotonic() < deadline, "the worker took no task after its import"
            await asyncio.sleep(0.05)
    finally:
        imported.set()
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        await r.aclose()


async def never_cancelled() -> None:
    return None


async def test_the_learner_counts_a_step_once_and_reports_dead_letters_and_duplicates(
    redis_url: str,
) -> None:
    from marl.clients.runs import RunInfo
    from marl.protocol.v1 import learner_pb2
    from services.learner.episodes import Episodes
    from services.learner.runs import run_key
    from services.learner.server import _run_message

    r = streams.connect(redis_url)
    spec = RunSpec.model_validate({"grpo": {"group_size": 2}})
    adapters = {"generator": AdapterRef("run-1/generator", 1)}

    episodes = Episodes("run-1", spec, r, "learner-1", lambda: adapters, never_cancelled,
                        max_queued_tasks=1)
    await episodes.open(fresh=True)
    await r.hset(run_key("run-1"), mapping={"run_id": "run-1", "state": "RUNNING"})

    async def fake_worker() -> None:
        """Answers the first task twice (a worker died between XADD and XACK); the second
        task is dead-lettered."""
        seen = 0
        while seen < 2:
            for e in await streams.read_group(r, streams.TASKS, streams.WORKERS_GROUP, "w",
                                              block_ms=100):
                seen += 1
                # max_queued_tasks=1: the second task waits until the first is done
                assert await r.xlen(streams.TASKS) == seen
                task = Task.from_dict(e.data)
                if task.sample == 1:
                    rollout = worker.dead_rollout(e, "w")
                else:
                    rollout = answered(task)
                for _ in range(2 if task.sample == 0 else 1):
                    await streams.add(r, streams.rollouts_stream("run-1"), rollout.to_dict())
                await streams.ack(r, streams.TASKS, streams.WORKERS_GROUP, e.id)

    try:
        producer = asyncio.create_task(fake_worker())
        got = await asyncio.wait_for(
            episodes.run([Problem(id="p", prompt="q", answer="1")], 0, "train"), 30
        )
        await producer
        assert [x.sample for x in got] == [0, 1]
        assert got[0].error is None and (got[1].error or "").startswith(streams.DEAD_LETTERED)
        record: Any = await r.hgetall(run_key("run-1"))
        info = RunInfo.from_proto(_run_message({**record, "step": 0, "total_steps": 1}))
        assert isinstance(_run_message(record), learner_pb2.Run)
        assert (info.dead_lettered, info.duplicate_rollouts) == (1, 1)
        assert info.to_dict()["dead_lettered"] == 1
    finally:
        await r.aclose()


async def test_a_step_whose_rollouts_are_all_in_still_sends_the_next_steps_tasks(
    redis_url: str,
) -> None:
    """With `train.max_staleness: 1` the learner submits step t+1, then gathers step t and
    trains it. When step t's rollouts were all read already (during step t-1's gather),
    step t+1's tasks must still reach the workers before the learner trains, or the workers
    sit idle through the update and the next step waits for a whole generation."""
    from services.learner.episodes import Episodes

    r = streams.connect(redis_url)
    spec = RunSpec.model_validate({"grpo": {"group_size": 2}})
    adapters = {"generator": AdapterRef("run-a/generator", 1)}

    async def answer_all(expected: int) -> None:
        """Waits for `expected` tasks in the stream, then sends all their rollouts in one
        MULTI/EXEC, so that one read of the learner's gets them all."""
        entries: list[streams.Entry] = []
        while len(entries) < expected:
            entries += await streams.read_group(r, streams.TASKS, streams.WORKERS_GROUP, "w",
                                                block_ms=100)
        async with r.pipeline(transaction=True) as pipe:
            for e in entries:
                rollout = answered(Task.from_dict(e.data))
                pipe.xadd(streams.rollouts_stream("run-a"), {"json": json.dumps(rollout.to_dict())})
            await pipe.execute()
        await streams.ack(r, streams.TASKS, streams.WORKERS_GROUP, *(e.id for e in entries))

    def problems(step: int) -> list[Problem]:
        return [Problem(id=f"p{step}", prompt="q", answer="1")]

    episodes = Episodes("run-a", spec, r, "learner-a", lambda: adapters, never_cancelled,
                        max_queued_tasks=LearnerConfig().max_queued_tasks)
    await episodes.open(fresh=True)
    try:
        step0 = episodes.submit(problems(0), 0, "train")
        step1 = episodes.submit(problems(1), 1, "train")
        worker_a = asyncio.create_task(answer_all(4))
        assert [x.step for x in await asyncio.wait_for(episodes.gather(step0), 30)] == [0, 0]
        await worker_a
        # step 0's gather read step 1's rollouts too: they arrived together
        assert len(episodes.arrived) == 2

        episodes.submit(problems(2), 2, "train")
        assert [x.step for x in await asyncio.wait_for(episodes.gather(step1), 30)] == [1, 1]
        waiting = await streams.read_group(r, streams.TASKS, streams.WORKERS_GROUP, "w",
                                           block_ms=10)
        assert [Task.from_dict(e.data).step for e in waiting] == [2, 2]
        assert episodes.queue == []
    finally:
        await r.aclose()


async def test_reading_ahead_stops_when_told_and_leaves_the_rest_to_the_gather(
    redis_url: str,
) -> None:
    """While the learner trains, `collect(..., stop)` reads the queued steps' rollouts (so
    the learner knows when generation is over). Told to stop, it returns within a read's
    block (50 ms), with no error even past the step's deadline, and what it read stays for
    the gather."""
    from services.learner.episodes import Episodes

    r = streams.connect(redis_url)
    spec = RunSpec.model_validate({"grpo": {"group_size": 2}, "train": {"step_timeout_s": 0.1}})
    adapters = {"generator": AdapterRef("run-s/generator", 1)}
    episodes = Episodes("run-s", spec, r, "learner-s", lambda: adapters, never_cancelled,
                        max_queued_tasks=LearnerConfig().max_queued_tasks)
    await episodes.open(fresh=True)
    try:
        pending = episodes.submit([Problem(id="p", prompt="q", answer="1")], 0, "train")
        wanted = {t.id for t in pending.tasks}
        stop = asyncio.Event()
        reader = asyncio.create_task(episodes.collect(wanted, stop))
        first = (await streams.read_group(r, streams.TASKS, streams.WORKERS_GROUP, "w",
                                          count=1, block_ms=1000))[0]
        await streams.add(r, streams.rollouts_stream("run-s"),
                          answered(Task.from_dict(first.data)).to_dict())
        await asyncio.sleep(0.3)  # past the step's 0.1 s deadline
        assert not reader.done()
        stop.set()
        t0 = time.monotonic()
        await asyncio.wait_for(reader, 1)
        assert time.monotonic() - t0 < 0.3
        assert set(episodes.arrived) == {Task.from_dict(first.data).id}

        second = (await streams.read_group(r, streams.TASKS, streams.WORKERS_GROUP, "w",
                                           block_ms=1000))[0]
        await streams.add(r, streams.rollouts_stream("run-s"),
                          answered(Task.from_dict(second.data)).to_dict())
        got = await asyncio.wait_for(episodes.gather(pending), 5)
        assert [x.sample for x in got] == [0, 1]
    finally:
        await r.aclose()


async def test_tasks_naming_a_version_still_being_pushed_wait_for_its_ack(
    redis_url: str,
) -> None:
    """An overlapped step queues the next step's tasks while their adapter version is still
    being pushed (`submit(..., after)`): they stay in the learner's queue, and so does any
    submission behind them, until the push's event is set; then they go out in order."""
    from services.learner.episodes import Episodes

    r = streams.connect(redis_url)
    spec = RunSpec.model_validate({"grpo": {"group_size": 2}})
    adapters = {"generator": AdapterRef("run-g/generator", 1)}
    episodes = Episodes("run-g", spec, r, "learner-g", lambda: adapters, never_cancelled,
                        max_queued_tasks=LearnerConfig().max_queued_tasks)
    await episodes.open(fresh=True)

    async def in_stream() -> list[int]:
        got = await streams.read_group(r, streams.TASKS, streams.WORKERS_GROUP, "w",
                                       block_ms=10)
        return [Task.from_dict(e.data).step for e in got]

    try:
        pushed = asyncio.Event()
        episodes.submit([Problem(id="p0", prompt="q", answer="1")], 0, "train")
        episodes.submit([Problem(id="p1", prompt="q", answer="1")], 1, "train", pushed)
        episodes.submit([Problem(id="p2", prompt="q", answer="1")], 2, "train")
        await episodes.add_tasks()
        assert await in_stream() == [0, 0]
        await episodes.add_tasks()
        assert await in_stream() == []
        assert len(episodes.queue) == 4
        pushed.set()
        await episodes.add_tasks()
        assert await in_stream() == [1, 1, 2, 2]
        assert episodes.queue == []
    finally:
        await r.aclose()


async def test_a_worker_loads_the_tokenizer_of_an_announced_model_before_any_task(
    redis_url: str,
) -> None:
    """A replica still joining announces its model: the worker loads that model's
    tokenizer while it waits for work, and a task's first episode finds it loaded."""
    model = os.path.realpath(demo_model_dir())
    r = streams.connect(redis_url)
    runner = worker.EpisodeRunner(r, "w1", replica_wait_s=0, judge_endpoints=())
    await replicas.announce(r, "inference", "i0", {"address": "127.0.0.1:1", "serving": False,
                                                   "model_path": model})
    try:
        async with working(runner):
            deadline = time.monotonic() + 20
            while model not in runner._tokenizers:
                assert time.monotonic() < deadline, "the announced model's tokenizer never loaded"
                await asyncio.sleep(0.05)
            assert await runner.tokenizer(str(demo_model_dir())) is runner._tokenizers[model]
            assert await r.xlen(streams.TASKS) == 0
    finally:
        await r.aclose()
