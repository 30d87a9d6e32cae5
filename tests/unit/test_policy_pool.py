"""`learner.warm_policy_processes`: policy processes that outlive their runs. A run's
policy (`learner.policy_process: own`) is built in an idle process the pool started
before, trains there as in a process of its own, and once the run closes it the process
waits for the next run's; the pool keeps no more idle than it was given."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from services.learner.policy_pool import PolicyPool
from services.learner.ranks import PolicyArgs, RankedPolicy
from services.learner.update import grpo_step
from tests.support.batches import ROLES, spec, voting_batch


def args(model_dir: Path, seed: int = 0) -> PolicyArgs:
    s = spec()
    return PolicyArgs(str(model_dir), ["shared"], s.lora, s.optim, 10, "float32", seed, "cpu")


def pid(policy: object) -> int:
    return os.getpid()


def adapter(policy: RankedPolicy) -> dict[str, torch.Tensor]:
    return policy.state_dict("shared")


def test_a_process_serves_run_after_run_each_as_a_fresh_one(model_dir: Path) -> None:
    s = spec(mini_batch_size=2)
    rollouts = voting_batch()
    groups = [r.problem_id for r in rollouts]
    fresh = RankedPolicy.start(args(model_dir), 1)
    try:
        want = fresh.call(grpo_step, rollouts, groups, ROLES["shared"], s)
        want_state = adapter(fresh)
    finally:
        fresh.close()

    pool = PolicyPool(1)
    try:
        first = RankedPolicy.start(args(model_dir, seed=1), 1, pool=pool)
        first_pid = first.call(pid)
        first.call(grpo_step, rollouts, groups, ROLES["shared"], s)  # leaves nothing behind
        first.close()
        second = RankedPolicy.start(args(model_dir), 1, pool=pool)
        try:
            assert second.call(pid) == first_pid != os.getpid()
            got = second.call(grpo_step, rollouts, groups, ROLES["shared"], s)
            got_state = adapter(second)
        finally:
            second.close()
    finally:
        pool.close()
    assert [m.loss for m in got.mini_batches] == pytest.approx(
        [m.loss for m in want.mini_batches], rel=1e-5, abs=1e-7
    )
    for k, v in want_state.items():
        torch.testing.assert_close(got_state[k], v, rtol=1e-5, atol=1e-7)


def test_the_pool_keeps_at_most_its_idle_count_and_ends_them_on_close(
    model_dir: Path,
) -> None:
    pool = PolicyPool(1)
    try:
        a = RankedPolicy.start(args(model_dir), 1, pool=pool)
        b = RankedPolicy.start(args(model_dir), 1, pool=pool)  # none idle: one started now
        procs = [a.procs[0], b.procs[0]]
        assert procs[0].pid != procs[1].pid
        a.close()
        a.close()  # closed twice, given back once
        b.close()  # one idle already: this one ends
        procs[1].join(10)
        assert not procs[1].is_alive() and procs[0].is_alive()
        c = RankedPolicy.start(args(model_dir), 1, pool=pool)
        d = RankedPolicy.start(args(model_dir), 1, pool=pool)
        try:
            assert c.procs[0] is procs[0] and d.procs[0].pid != procs[0].pid
        finally:
            c.close()
            d.close()
    finally:
        pool.close()
    procs[0].join(10)
    assert not procs[0].is_alive()


def test_a_dead_idle_process_is_not_handed_to_a_run(model_dir: Path) -> None:
    pool = PolicyPool(1)
    try:
        run = RankedPolicy.start(args(model_dir), 1, pool=pool)
        dead = run.procs[0]
        run.close()
        assert dead.pid is not None
        os.kill(dead.pid, signal.SIGKILL)
        dead.join(10)
        again = RankedPolicy.start(args(model_dir), 1, pool=pool)
        try:
            assert again.call(pid) != dead.pid
        finally:
            again.close()
    finally:
        pool.close()
