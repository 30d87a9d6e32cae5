"""Signed tasks: a worker holding the services' token runs only tasks signed with it; a task
forged into Redis is refused (counted, acknowledged, never run, no run told); with
authentication off every task runs, as before. The work loop runs on a real redis-server."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import REGISTRY

from marl.rollout import Rollout, Task
from marl.runtime import streams
from marl.runtime.task_signing import PAYLOAD_FIELD, SIGNATURE_FIELD, TaskSigner, canonical
from services.workflow import worker
from tests.support.tasks import a_task, answered
from tests.support.worker_loop import working

TOKEN = "service-token-1"


def test_signed_fields_verify_and_any_change_is_refused() -> None:
    signer = TaskSigner(TOKEN)
    payload = a_task().to_dict()
    fields = signer.fields(streams.TASKS, payload)
    assert fields[PAYLOAD_FIELD] == canonical(payload)
    assert len(fields[SIGNATURE_FIELD]) == 64
    assert signer.refusal(streams.TASKS, fields) is None
    assert TaskSigner(TOKEN).refusal(streams.TASKS, fields) is None  # another process

    tampered = {**fields, PAYLOAD_FIELD: fields[PAYLOAD_FIELD].replace("run-1", "run-2")}
    assert signer.refusal(streams.TASKS, tampered) == "bad_signature"
    assert signer.refusal("marl:other", fields) == "bad_signature"
    assert TaskSigner("another-token").refusal(streams.TASKS, fields) == "bad_signature"
    assert signer.refusal(streams.TASKS, {PAYLOAD_FIELD: fields[PAYLOAD_FIELD]}) == "unsigned"
    assert signer.refusal(streams.TASKS, {**fields, SIGNATURE_FIELD: "é"}) == "bad_signature"
    assert signer.refusal(streams.TASKS, {SIGNATURE_FIELD: fields[SIGNATURE_FIELD]}) == "unsigned"


def test_without_a_token_nothing_is_signed_and_everything_is_accepted() -> None:
    signer = TaskSigner(None)
    fields = signer.fields(streams.TASKS, {"a": 1})
    assert fields == {PAYLOAD_FIELD: '{"a":1}'}
    assert signer.refusal(streams.TASKS, fields) is None
    assert signer.refusal(streams.TASKS, {"junk": "x"}) is None


class RecordingRunner(worker.EpisodeRunner):
    """A worker whose episodes succeed at once; it records the runs whose tasks it ran."""

    def __init__(self, redis: object, worker_id: str):
        super().__init__(redis, worker_id, replica_wait_s=0, judge_endpoints=())
        self.ran: list[str] = []

    async def run(self, task: Task) -> Rollout:
        self.ran.append(task.run_id)
        return answered(task)


def refused(reason: str) -> float:
    return REGISTRY.get_sample_value("marl_tasks_refused_total", {"reason": reason}) or 0.0


def forged(run_id: str) -> dict[str, object]:
    task = a_task().to_dict()
    task["run_id"] = run_id
    return task


async def test_deny_forged_tasks_a_worker_with_the_token_runs_only_signed_ones(
    redis_url: str,
) -> None:
    r = streams.connect(redis_url)
    signer = TaskSigner(TOKEN)
    before = refused("unsigned"), refused("bad_signature")
    try:
        await streams.ensure_group(r, streams.TASKS, streams.WORKERS_GROUP)
        for run in ("run-1", "forged-unsigned", "forged-badsig", "forged-junk"):
            await streams.ensure_group(r, streams.rollouts_stream(run), "learner")
        await r.xadd(streams.TASKS, {PAYLOAD_FIELD: canonical(forged("forged-unsigned"))})
        bad = TaskSigner("a-guessed-token").fields(streams.TASKS, forged("forged-badsig"))
        await r.xadd(streams.TASKS, bad)
        await r.xadd(streams.TASKS, {"junk": "not a task"})
        await r.xadd(streams.TASKS, signer.fields(streams.TASKS, a_task().to_dict()))
        runner = RecordingRunner(r, "w1")
        async with working(runner, signer=signer):
            deadline = time.monotonic() + 20
            while not runner.ran or await r.xlen(streams.TASKS) > 1:
                assert time.monotonic() < deadline, "the worker did not get through the tasks"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)
        assert runner.ran == ["run-1"]
        assert (refused("unsigned") - before[0], refused("bad_signature") - before[1]) == (2, 1)
        assert (await r.xpending(streams.TASKS, streams.WORKERS_GROUP))["pending"] == 0
        assert not await r.exists(streams.dead_letter_stream(streams.TASKS))
        for run in ("forged-unsigned", "forged-badsig"):
            assert await r.xlen(streams.rollouts_stream(run)) == 0
        assert await r.xlen(streams.rollouts_stream("run-1")) == 1
    finally:
        await r.aclose()


async def test_allow_unsigned_tasks_with_authentication_off(redis_url: str) -> None:
    r = streams.connect(redis_url)
    try:
        await streams.ensure_group(r, streams.TASKS, streams.WORKERS_GROUP)
        await streams.ensure_group(r, streams.rollouts_stream("run-1"), "learner")
        await streams.add(r, streams.TASKS, a_task().to_dict())
        runner = RecordingRunner(r, "w1")
        async with working(runner):
            deadline = time.monotonic() + 20
            while not runner.ran:
                assert time.monotonic() < deadline, "the unsigned task did not run"
                await asyncio.sleep(0.05)
        assert runner.ran == ["run-1"]
    finally:
        await r.aclose()
