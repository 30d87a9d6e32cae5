"""A learner group started by torch's own launcher (torchrun, env://) trains as one
process does, and its checkpoints (DCP shards, services/learner/dcp_state.py) move between
world sizes.

torchrun starts two ranks of `launched_learner.py` over gloo on loopback: rank 0 drives
them through services/learner/group.py as a launched `marl serve learner` does. Step 1
on the group gives the one-process step's losses and adapters; the group's checkpoint
(world size 2) resumes in one process, and the one-process checkpoint (world size 1)
resumes on the group, each with the next-step losses of the uninterrupted one-process run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from launched_learner import small_steps

from marl.runtime.processes import free_port
from services.learner import checkpoint
from services.learner.group import launch_size
from services.learner.update import grpo_step
from tests.support.batches import ROLES, new_policy, voting_batch

HERE = Path(__file__).parent


def losses(policy, seed: int) -> list[float]:  # type: ignore[no-untyped-def]
    s = small_steps()
    rollouts = voting_batch(seed)
    result = grpo_step(policy, rollouts, [r.problem_id for r in rollouts], ROLES["isolated"], s)
    return [m.loss for m in result.mini_batches]


@pytest.fixture
def one_thread() -> Iterator[None]:
    """This process sums as the ranks (OMP_NUM_THREADS=1) do: AdamW magnifies the last bit
    of a near-zero gradient, which another thread count's float32 order changes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_torchrun_group_trains_as_one_process_and_checkpoints_reshard(
    model_dir: Path, tmp_path: Path, one_thread: None
) -> None:
    s = small_steps()
    one = new_policy(model_dir, "isolated", s)
    want_first = losses(one, 0)
    want_states = {p: one.state_dict(p) for p in one.policies}
    checkpoint.save(tmp_path / "one", 1, one, {"data_position": 0})
    want_next = losses(one, 1)

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{HERE}:{os.getcwd()}"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    (tmp_path / "two").mkdir()
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
         "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
         str(HERE / "launched_learner.py"), str(model_dir), str(tmp_path / "two"),
         str(tmp_path / "one" / "checkpoints" / "step_000001")],
        env=env, check=True, timeout=600,
    )
    got = torch.load(tmp_path / "two" / "result.pt", weights_only=True)

    assert got["world_size"] == 2
    # DCP state: each rank wrote its own shards; one process, one file
    def shards(run: str) -> list[str]:
        ckpt = tmp_path / run / "checkpoints" / "step_000001"
        return sorted(p.name for p in (ckpt / "dcp").glob("*.distcp"))

    assert shards("two") == ["__0_0.distcp", "__1_0.distcp"]
    assert shards("one") == ["__0_0.distcp"]
    assert got["losses"] == pytest.approx(want_first, rel=1e-5, abs=1e-6)
    for p, state in want_states.items():
        for k, v in state.items():
            torch.testing.assert_close(got["states"][p][k], v, rtol=1e-5, atol=1e-7)
    # written at world size 1, resumed at 2
    assert got["next_losses"] == pytest.approx(want_next, rel=1e-5, abs=1e-6)
    # written at world size 2, resumed at 1
    fresh = new_policy(model_dir, "isolated", s)
    checkpoint.load(tmp_path / "two" / "checkpoints" / "step_000001", fresh)
    assert losses(fresh, 1) == pytest.approx(want_next, rel=1e-5, abs=1e-6)


def test_a_partial_launch_environment_is_refused_naming_what_is_missing() -> None:
    assert launch_size({}) == 1
    assert launch_size({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h",
                        "MASTER_PORT": "1"}) == 2
    with pytest.raises(ValueError, match="WORLD_SIZE is set but MASTER_ADDR, MASTER_PORT"):
        launch_size({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="RANK=2 is not a rank of WORLD_SIZE=2"):
        launch_size({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
