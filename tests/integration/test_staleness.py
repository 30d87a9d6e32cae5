"""Bounded staleness (`train.max_staleness`) on real processes and a real Redis: with K = 1
the learner trains step t while workers generate step t+1, every trained turn is at most
one version behind, the update takes the inference replica's core once step t+1's rollouts
are in, and `staleness_scope: turn` episodes take a newer version mid-episode.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from marl.local.launcher import Cluster, service_threads
from tests.support.cluster import ClusterFactory, learner_spans
from tests.support.runs import rows, submit, wait_end
from tests.support.specs import small_spec

OVERLAPPED: dict[str, Any] = {
    "sandbox_replicas": 0,
    # the split an overlapped run gets: inference 1 thread, learner 1, or 2 once the
    # rollouts queued ahead are in
    "threads": service_threads(2, overlapped=True),
    "traced": True,
}
pytestmark = [
    pytest.mark.timeout(600),
    # two workers of 3 episodes at a time
    pytest.mark.cluster(env={"MARL_WORKFLOW_CONCURRENCY": "3"}, workflow_replicas=2, **OVERLAPPED),
]

STEPS = 6


def one_at_a_time(module_clusters: ClusterFactory) -> Cluster:
    """One worker, one episode at a time: a step's episodes take several times as long to
    generate as to train, however fast the engine answers, so every push lands while an
    episode is under way."""
    return module_clusters(
        env={"MARL_WORKFLOW_CONCURRENCY": "1"}, workflow_replicas=1, **OVERLAPPED
    )


def logged_rollouts(out: Path, step: int) -> list[dict[str, Any]]:
    path = out / "rollouts" / f"step_{step:06d}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def run(cluster: Cluster, tmp_path: Path, name: str, problems: int = 4,
        workflow: str = "voting", learner: dict[str, Any] | None = None,
        **train: Any) -> tuple[Path, str]:
    out = tmp_path / name
    spec = small_spec(name, out, steps=STEPS, group=4, problems=problems)
    spec["workflow"] = workflow
    spec["train"].update(train)
    if learner is not None:
        spec["learner"] = learner
    run_id = submit(cluster, spec)
    result = wait_end(cluster, run_id)
    assert result.state == "SUCCEEDED", result.error
    return out, run_id


def one_version_behind(out: Path) -> list[dict[str, Any]]:
    """A K = 1 run's step records, checked: in order, no errors, nothing stale, and each
    step's turns served by exactly one version behind the one that trained them."""
    records = [r for r in rows(out) if r["step"] > 0]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert r["train/episode_errors"] == 0
        assert r["train/stale_dropped"] == 0
        assert r["train/staleness_max"] <= 1
    # the learner trained step s (logged as s + 1) with version s; step s's tasks were
    # queued while it trained step s - 1, with version s - 1: one version behind
    for step in range(2, STEPS + 1):
        versions = {t["adapter"]["version"] for r in logged_rollouts(out, step)
                    for t in r["turns"]}
        assert versions == {step - 2}, (step, versions)
    assert {t["adapter"]["version"] for r in logged_rollouts(out, 1) for t in r["turns"]} == {0}
    return records


@pytest.mark.parametrize("policy_process", ["server", "own"])
def test_one_step_ahead_trains_turns_at_most_one_version_old(
    cluster: Cluster, tmp_path: Path, policy_process: str
) -> None:
    """In the learner server's process or one of its own (`learner.policy_process`), whose
    forwards the server's burst still paces."""
    out, run_id = run(cluster, tmp_path, "k1", learner={"policy_process": policy_process},
                      max_staleness=1, checkpoint_interval=1, checkpoints_kept=STEPS)
    records = one_version_behind(out)
    learner_log = next(p.log_path for p in cluster.processes if p.kind == "learner")
    assert ("learner policy process up" in learner_log.read_text()) == (policy_process == "own")
    for r in records:
        assert 0 < r["train/importance_weight_mean"] <= 2.0
        assert 0 <= r["time/update_burst_s"] <= r["time/update_s"]
    # the last step has nothing queued ahead: its whole update has both cores
    assert records[-1]["time/update_burst_s"] > 0
    # each checkpoint's data position is where its next step's problems start, though the
    # learner had drawn that step's problems already: a resumed run queues them again
    for step in range(1, STEPS + 1):
        state = json.loads((out / "checkpoints" / f"step_{step:06d}" / "state.json").read_text())
        assert state["data_position"] == 4 * step, (step, state)


def test_overlapped_push_and_record_keep_the_version_pattern(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Steps with no checkpoint or validation due push their adapters and log their
    record while the next step trains (`RunExecutor.finish`); the next step's tasks wait
    for the push's ack. The versions that served each step and the records' order are
    those of the run above, whose every step checkpoints and so does neither."""
    out, run_id = run(cluster, tmp_path, "overlap", max_staleness=1, checkpoint_interval=100)
    records = one_version_behind(out)
    # steps 1..STEPS-1 overlapped; the last checkpoints (and validates), so waits for it
    assert all(r["time/push_overlapped_s"] > 0 for r in records[:-1])
    assert "time/push_overlapped_s" not in records[-1]
    # a run alone on its learner hands its heap back once, as it ends, not after each step
    # (`RunExecutor.trim_each_step`), and the trim waits for any update on the torch thread
    trims = learner_spans(cluster, "heap trim", run=run_id)
    updates = learner_spans(cluster, "grpo step")
    assert len(trims) == 1, trims
    assert sum(end <= trims[0][0] for _, end in updates) >= STEPS
    assert all(end <= trims[0][0] or start >= trims[0][1] for start, end in updates)


def test_a_guard_stop_on_an_overlapped_step_stops_there(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A step whose record fires an alarm the guard acts on does not overlap: the run stops
    at that step, with its record written, before another update is logged. At K = 1 the
    learner's π_old is a version ahead of the sampler from the second step on, so a
    `sampler_mismatch` threshold of 1e-4 nats fires there (the first step's gap is the
    engines' rounding alone, ~1e-7)."""
    out = tmp_path / "stop"
    spec = small_spec("stop", out, steps=STEPS, group=4, problems=4)
    spec["train"].update(max_staleness=1, checkpoint_interval=100)
    spec["alarms"] = {"logprob_gap_max": 1e-4}
    spec["guard"] = {"on_alarm": {"sampler_mismatch": "stop"}}
    result = wait_end(cluster, submit(cluster, spec))
    assert result.state == "FAILED"
    assert "stopped by guard.on_alarm.sampler_mismatch=stop" in result.error
    records = rows(out)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert "guard" not in records[1] and "time/push_overlapped_s" in records[1]
    assert records[2]["guard"].startswith("stop: sampler_mismatch")
    assert "time/push_overlapped_s" not in records[2]


def test_synchronous_run_is_on_policy(cluster: Cluster, tmp_path: Path) -> None:
    """No step of this run validates before the last, so from the second on each step's
    tasks left for the workers after the step before pushed and before it was logged and
    checkpointed: they were in flight longer than the learner waited for them, and were
    served by the version that step pushed, the one that trains them. Each checkpoint's
    data position is where its next step's problems start, drawn already or not."""
    out, _ = run(cluster, tmp_path, "k0", checkpoint_interval=1, checkpoints_kept=STEPS)
    records = [r for r in rows(out) if r["step"] > 0]
    for r in records:
        assert r["train/staleness_max"] == 0
        assert "train/importance_weight_mean" not in r
        assert "time/update_burst_s" not in r  # a synchronous update has every core anyway
    for step in range(1, STEPS + 1):
        versions = {t["adapter"]["version"] for r in logged_rollouts(out, step)
                    for t in r["turns"]}
        assert versions == {step - 1}
    flights = [(r["time/rollout_flight_s"], r["time/rollout_s"]) for r in records]
    assert flights[0][0] <= flights[0][1]  # queued at its step's start, after validation
    assert all(flight > waited for flight, waited in flights[1:]), flights
    for step in range(1, STEPS + 1):
        state = json.loads((out / "checkpoints" / f"step_{step:06d}" / "state.json").read_text())
        assert state["data_position"] == 4 * step, (step, state)


def test_turn_scope_episodes_take_newer_versions_mid_episode(
    module_clusters: ClusterFactory, tmp_path: Path
) -> None:
    # Eval-Opt's turns are sequential (generator, evaluator, up to 3 rounds), so the one
    # episode under way when a push lands most likely has a turn left
    out, _ = run(one_at_a_time(module_clusters), tmp_path, "turn", workflow="eval_opt", max_staleness=1,
                 staleness_scope="turn")
    changed = 0
    for step in range(1, STEPS + 1):
        for r in logged_rollouts(out, step):
            versions = [t["adapter"]["version"] for t in r["turns"]]
            assert max(versions) <= step - 1 and min(versions) >= step - 2
            changed += versions != sorted(versions) or len(set(versions)) > 1
    print(f"\n{changed} episodes changed version between turns")
    assert changed > 0


def test_tasks_queued_k_versions_ahead_find_their_version(
    module_clusters: ClusterFactory, tmp_path: Path
) -> None:
    """K = 2 on replicas that keep 2 versions of an adapter by their own setting: with one
    episode at a time, a step's last tasks start after two more pushes, and each push asks
    the replica to keep K + 1 = 3 versions (`AdapterManifest.keep_versions`). Before it
    did, ~90 % of such a run's episodes failed with 'adapter ... is not loaded'."""
    out, _ = run(one_at_a_time(module_clusters), tmp_path, "k2", workflow="single", max_staleness=2)
    records = [r for r in rows(out) if r["step"] > 0]
    assert [r["train/episode_errors"] for r in records] == [0] * STEPS
    assert all(r["train/stale_dropped"] == 0 for r in records)
    assert max(r["train/staleness_max"] for r in records) == 2
