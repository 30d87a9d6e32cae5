"""`learner.policy_process: own`: a one-process learner's policy in a process the server
spawns, trained as in the server's own, its forwards paced by a ThreadBurst the server
drives from its side of the process boundary."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from marl.spec.run import parse_spec
from services.learner.ranks import PolicyArgs, RankedPolicy, RankFailed, policy_elsewhere
from services.learner.threads import ThreadBurst
from services.learner.update import grpo_step
from tests.support.batches import ROLES, new_policy, spec, voting_batch


def own_process(model_dir: Path, burst: ThreadBurst | None = None) -> RankedPolicy:
    s = spec()
    args = PolicyArgs(str(model_dir), ["shared"], s.lora, s.optim, 10, "float32", 0, "cpu")
    return RankedPolicy.start(args, 1, burst)


def where(policy: object) -> tuple[int, bool]:
    return os.getpid(), torch.distributed.is_initialized()


def paced_threads(policy: object) -> int:
    policy.pace()  # type: ignore[attr-defined]
    return torch.get_num_threads()


def test_own_process_trains_as_the_server_process_does(model_dir: Path) -> None:
    s = spec(mini_batch_size=2)
    rollouts = voting_batch()
    groups = [r.problem_id for r in rollouts]
    torch.manual_seed(0)
    here = new_policy(model_dir, "shared", s)
    want = grpo_step(here, rollouts, groups, ROLES["shared"], s)

    apart = own_process(model_dir)
    try:
        pid, grouped = apart.call(where)
        got = apart.call(grpo_step, rollouts, groups, ROLES["shared"], s)
        state = apart.state_dict("shared")
        apart.release_free_heap()
    finally:
        apart.close()

    assert pid != os.getpid()
    assert not grouped  # one process: no torch.distributed group, fsdp is the identity
    assert [m.loss for m in got.mini_batches] == pytest.approx(
        [m.loss for m in want.mini_batches], rel=1e-5, abs=1e-7
    )
    for k, v in here.state_dict("shared").items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-7)


def test_the_server_paces_the_forwards_of_a_policy_in_its_own_process(
    model_dir: Path,
) -> None:
    burst = ThreadBurst(share=1, burst=2)
    apart = own_process(model_dir, burst)
    try:
        burst.start_step()
        assert apart.call(paced_threads) == 1
        assert burst.burst_seconds() == 0.0
        burst.rollouts_in()
        assert apart.call(paced_threads) == 2
        assert burst.burst_seconds() > 0.0  # the policy's process said when, in shared memory
        burst.start_step()
        assert burst.burst_seconds() == 0.0
        assert apart.call(paced_threads) == 1
    finally:
        apart.close()


def test_a_killed_policy_process_fails_the_call_naming_it(model_dir: Path) -> None:
    apart = own_process(model_dir)
    pid = apart.procs[0].pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(
        RankFailed, match=rf"learner policy process \(pid {pid}\) was killed by SIGKILL"
    ):
        apart.call(where)



@pytest.mark.parametrize(
    ("learner", "elsewhere"),
    [({}, False), ({"policy_process": "own"}, True), ({"world_size": 2}, True)],
)
def test_a_policy_elsewhere_is_one_the_server_only_waits_on(
    learner: dict[str, object], elsewhere: bool
) -> None:
    """Such a run's calls wait on a thread of the run's own (RunExecutor), so the runs one
    learner trains at once update side by side rather than in turns."""
    assert policy_elsewhere(parse_spec({"learner": learner})) is elsewhere
