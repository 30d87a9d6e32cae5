"""ThreadBurst: the learner's update keeps its share of threads until the event loop says
every rollout queued ahead is in, then takes the burst at its next forward, on the thread
that runs the forwards (OpenMP's thread count belongs to the calling thread), in this
process or in the policy's own."""

from __future__ import annotations

from pathlib import Path

import torch

from marl.runtime.torch_thread import TorchThread
from services.learner.threads import ThreadBurst
from tests.support.batches import new_policy, spec, step, voting_batch


def test_the_burst_comes_at_the_first_forward_after_the_rollouts_are_in() -> None:
    worker = TorchThread("test")
    burst = ThreadBurst(share=1, burst=2)
    here = torch.get_num_threads()
    try:
        burst.start_step()  # from the event loop, or another process
        worker.call(burst.pace)
        assert worker.call(torch.get_num_threads) == 1
        assert burst.burst_seconds() == 0.0

        burst.rollouts_in()  # from another thread: the event loop's
        assert worker.call(torch.get_num_threads) == 1  # not until the next forward
        worker.call(burst.pace)
        assert worker.call(torch.get_num_threads) == 2
        assert burst.burst_seconds() > 0.0
        assert torch.get_num_threads() == here  # only the torch thread's count moved

        burst.start_step()  # the next step: its tasks generate again
        assert burst.burst_seconds() == 0.0
        assert worker.call(torch.get_num_threads) == 2  # not until the next forward
        worker.call(burst.pace)
        assert worker.call(torch.get_num_threads) == 1
    finally:
        worker.close()


def test_a_burst_no_larger_than_the_share_is_off() -> None:
    assert not ThreadBurst(share=2, burst=2).enabled
    assert not ThreadBurst(share=2, burst=0).enabled
    assert ThreadBurst(share=1, burst=2).enabled
    assert ThreadBurst.of_this_process(0) is None
    made = ThreadBurst.of_this_process(torch.get_num_threads() + 1)
    assert made is not None and made.share == torch.get_num_threads()


def test_an_update_paces_before_its_forwards_and_bursts_midway(model_dir: Path) -> None:
    """A whole GRPO step (old log-probs, mini-batches, drift sample) on the torch thread:
    `pace` runs before each forward, so a burst asked for midway is taken midway."""
    s = spec(mini_batch_size=2)
    worker = TorchThread("test")
    policy = worker.call(new_policy, model_dir, "shared", s)
    burst = ThreadBurst(share=1, burst=2)
    threads_seen: list[int] = []

    def pace() -> None:
        if len(threads_seen) == 3:
            burst.rollouts_in()
        burst.pace()
        threads_seen.append(torch.get_num_threads())

    policy.pace = pace
    rollouts = voting_batch()
    try:
        burst.start_step()
        worker.call(step, policy, rollouts, "shared", s)
    finally:
        worker.close()
    # 32 sequences in micro-batches of 5: 7 forwards for the old log-probs alone
    assert len(threads_seen) > 7
    assert threads_seen[:4] == [1, 1, 1, 2]
    assert set(threads_seen[3:]) == {2}
