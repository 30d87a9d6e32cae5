"""A checkpoint records where the training data order stands; a resumed run goes on from there.

The learner checkpoints `{"data_position": sampler.position}` and, resuming, builds its
sampler at the restored position over the reloaded training set (services/learner/trainer.py, sampler.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from marl.data import load_problems
from marl.problem import Problem
from marl.spec.run import DataSpec, LoraSpec, OptimSpec
from services.learner import checkpoint
from services.learner.policy import MultiAdapterPolicy
from services.learner.sampler import DataSampler

SEED = 3
PER_STEP = 2
PROBLEMS = [Problem(id=f"p{i}", prompt=f"problem {i}") for i in range(6)]
# the order the seed gives: epoch 0 is p2 p1 p4 p3 p5 p0, then epoch 1 reshuffles
STEPS = [["p2", "p1"], ["p4", "p3"], ["p5", "p0"], ["p0", "p1"], ["p2", "p5"]]


def new_policy(model_dir: Path) -> MultiAdapterPolicy:
    return MultiAdapterPolicy(str(model_dir), ["shared"], LoraSpec(rank=2, alpha=4),
                              OptimSpec(), total_steps=10)


def ids(problems: list[Problem]) -> list[str]:
    return [p.id for p in problems]


def test_sampler_order_is_fixed_by_the_seed() -> None:
    sampler = DataSampler(PROBLEMS, SEED)
    assert [ids(sampler.next(PER_STEP)) for _ in STEPS] == STEPS
    assert sampler.position == PER_STEP * len(STEPS)


@pytest.mark.parametrize("steps_done", [1, 3, 4])  # mid-epoch, at the epoch's end, past it
def test_resume_from_checkpoint_continues_with_the_next_problems(
    model_dir: Path, tmp_path: Path, steps_done: int
) -> None:
    policy = new_policy(model_dir)
    sampler = DataSampler(PROBLEMS, SEED)
    for step in range(steps_done):
        assert ids(sampler.next(PER_STEP)) == STEPS[step]
        policy.updates += 1
        checkpoint.save(tmp_path, step + 1, policy, {"data_position": sampler.position})

    # a new learner process: fresh policy, the set reloaded, the latest checkpoint restored
    restored = checkpoint.load_latest(tmp_path, new_policy(model_dir))
    assert restored is not None
    assert restored["step"] == steps_done
    assert restored["data_position"] == PER_STEP * steps_done
    resumed = DataSampler(list(PROBLEMS), SEED, position=int(restored["data_position"]))
    assert ids(resumed.next(PER_STEP)) == STEPS[steps_done]  # not a repeat of STEPS[0]


def test_no_checkpoint_starts_at_the_beginning(model_dir: Path, tmp_path: Path) -> None:
    assert checkpoint.load_latest(tmp_path, new_policy(model_dir)) is None
    assert ids(DataSampler(PROBLEMS, SEED).next(PER_STEP)) == STEPS[0]


@pytest.mark.parametrize("dataset", ["humaneval", "champ"])
def test_bundled_training_sets_reload_in_the_same_order(dataset: str) -> None:
    """Resuming by position is only exact if the reloaded set lists the same problems."""
    spec = DataSpec(train=dataset, val=dataset)
    first = load_problems(spec, "train", seed=SEED)
    again = load_problems(spec, "train", seed=SEED)
    assert ids(first) == ids(again)
    original = DataSampler(first, SEED)
    step_1, step_2 = ids(original.next(4)), ids(original.next(4))
    assert ids(DataSampler(again, SEED, position=4).next(4)) == step_2
    assert not set(step_1) & set(step_2)


def test_a_step_across_the_epoch_boundary_holds_distinct_problems() -> None:
    # 5 problems, 2 per step, seed 3: epoch 0 ends with p0 and epoch 1 starts with p0
    five = PROBLEMS[:5]
    sampler = DataSampler(five, SEED)
    steps = [ids(sampler.next(PER_STEP)) for _ in range(3)]
    assert steps[2][0] == "p0"
    assert len(set(steps[2])) == PER_STEP, steps
    assert sampler.position == 7  # epoch 1's p0 was skipped, not served twice


def test_more_problems_per_step_than_the_set_repeats_rather_than_stalls() -> None:
    sampler = DataSampler(PROBLEMS[:2], SEED)
    assert len(sampler.next(3)) == 3
