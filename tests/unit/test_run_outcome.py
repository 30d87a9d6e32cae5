"""A run's failed steps and episodes (services/learner/outcome.py) and where they show:
the run record in Redis, GetRun's message and `marl status --json`'s fields."""

from __future__ import annotations

from marl.clients.runs import RunInfo
from marl.runtime import streams
from marl.spec.run import TrainSpec
from services.learner.outcome import Outcome, step_failed
from services.learner.runs import RunStore
from services.learner.server import _run_message
from services.learner.sinks import RunRecordSink


def step(n: int, episodes: int, failed: int, max_failed_fraction: float = 0.5) -> dict:
    return {
        "step": n,
        "train/episodes": episodes,
        "train/episode_errors": failed,
        "train/failed_step": int(step_failed(episodes, failed, max_failed_fraction)),
    }


def test_a_step_fails_above_its_share_of_failed_episodes() -> None:
    assert not step_failed(8, 4, 0.5)  # half is not above half
    assert step_failed(8, 5, 0.5)
    assert step_failed(8, 1, 0.0)
    assert not step_failed(8, 8, 1.0)
    assert not step_failed(0, 0, 0.5)


def test_every_other_step_failing_fails_the_run_with_the_counts() -> None:
    outcome = Outcome()
    outcome.note({"step": 0, "val/accuracy": 0.1})  # validation only: counts nothing
    for n in range(1, 5):
        outcome.note(step(n, 8, 6 if n % 2 == 0 else 0))
    assert outcome.fields() == {
        "steps_done": 4,
        "failed_steps": 2,
        "episodes": 32,
        "failed_episodes": 12,
    }
    why = outcome.verdict(TrainSpec())
    assert why is not None and why.startswith("2 of 4 steps failed")
    assert "train.max_failed_fraction=0.5" in why and "train.max_failed_steps=0.2" in why
    assert "12 of 32 episodes failed" in why
    assert outcome.verdict(TrainSpec(max_failed_steps=0.5)) is None  # 2 of 4 is not above
    assert outcome.verdict(TrainSpec(max_failed_steps=1.0)) is None


def test_a_run_with_few_failed_steps_succeeds() -> None:
    outcome = Outcome()
    for n in range(1, 11):
        outcome.note(step(n, 8, 8 if n in (3, 7) else 1))
    assert (outcome.failed_steps, outcome.failed_episodes) == (2, 24)
    assert outcome.verdict(TrainSpec()) is None  # 2 of 10 is not above 0.2
    assert Outcome().verdict(TrainSpec()) is None


async def test_the_record_in_redis_carries_the_counts_and_a_resume_recounts(
    redis_url: str,
) -> None:
    r = streams.connect(redis_url)
    try:
        store = RunStore(r)
        await store.create("run-1", "{}", "/tmp/x", 4)
        sink = RunRecordSink(store, "run-1")
        records = [step(n, 8, 6 if n % 2 == 0 else 0) for n in range(1, 4)]
        for record in records:
            await sink.write(record["step"], record)
        await sink.note_unlogged(8, 8, True)  # a step that ended the run before its record
        d = await store.get("run-1")
        assert d is not None
        run = RunInfo.from_proto(_run_message(d))
        assert (run.steps_done, run.failed_steps, run.episodes, run.failed_episodes) == (
            4,
            2,
            32,
            14,
        )
        assert {k: run.to_dict()[k] for k in ("failed_steps", "failed_episodes")} == {
            "failed_steps": 2,
            "failed_episodes": 14,
        }

        # a learner taking the run over replays the records it keeps: each counted once
        again = RunRecordSink(store, "run-1")
        await again.restore(records[:2])
        d = await store.get("run-1")
        assert d is not None
        assert _run_message(d).steps_done == 2 and _run_message(d).failed_episodes == 6
    finally:
        await r.aclose()
