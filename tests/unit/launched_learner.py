"""One rank of a learner group started by torch's launcher (`torchrun ... launched_learner.py
MODEL_DIR OUT CKPT_FROM`), for test_launched_learner.py: the learner's own group code
(services/learner/group.py), not a copy of it.

Rank 0 trains step 1 of the Voting batch on the whole group and checkpoints it under
OUT; then opens a second policy, resumes it from CKPT_FROM (a checkpoint written at another
world size) and trains step 2. It writes both steps' mini-batch losses and the adapters
after step 1 to OUT/result.pt. The other ranks follow rank 0 as a launched learner's do.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from marl.spec.run import RunSpec
from services.learner import checkpoint, group
from services.learner.ranks import PolicyArgs
from services.learner.update import grpo_step
from tests.support.batches import ROLES, spec, voting_batch


def small_steps() -> RunSpec:
    """Three optimizer steps per adapter in the step, at a rate small enough that AdamW
    does not magnify float32 summation order (ranks vs one process) past 1e-5."""
    s = spec(mini_batch_size=2, micro_batch_sequences=3)
    return s.model_copy(update={"optim": s.optim.model_copy(update={"lr": 0.01})})


def step(policy: group.GroupPolicy, seed: int) -> list[float]:
    s = small_steps()
    rollouts = voting_batch(seed)
    result = policy.call(grpo_step, rollouts, [r.problem_id for r in rollouts], ROLES["isolated"], s)
    return [m.loss for m in result.mini_batches]


def main(model_dir: str, out: Path, ckpt_from: Path) -> None:
    joined = group.join()
    assert joined is not None
    if joined.rank != 0:
        group.follow(joined)
        return
    s = small_steps()
    args = PolicyArgs(model_dir, ["aggregator", "generator"], s.lora, s.optim, 10, "float32", 0,
                      "cpu")
    first = group.GroupPolicy.open(args, joined, None)
    sizes = first.call(world_size)
    losses = step(first, 0)
    states = {p: first.state_dict(p) for p in first.policies}
    checkpoint.save(out, 1, first, {"data_position": 0})
    first.close()
    resumed = group.GroupPolicy.open(args, joined, None)
    checkpoint.load(ckpt_from, resumed)
    next_losses = step(resumed, 1)
    resumed.close()
    group.stop(joined)
    torch.save({"world_size": sizes, "losses": losses, "states": states,
                "next_losses": next_losses}, out / "result.pt")


def world_size(policy: object) -> int:
    return int(policy.world_size)  # type: ignore[attr-defined]


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
