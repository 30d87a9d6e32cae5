"""DAPO's dynamic sampling (`grpo.dynamic_sampling`): groups whose rewards (as shaped) are
all equal carry no comparison, so they make way and the step is topped up from the next
problems of the data order."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from marl.rollout import Rollout
from marl.spec.run import RunSpec
from services.learner.advantages import good_rollouts, shaped_rewards, signal_groups
from services.learner.records import dynamic_sampling_metrics


def groups_with_signal(rollouts: list[Rollout], spec: RunSpec) -> list[str]:
    """The problems (groups) of `rollouts` that train and carry a comparison, in the order
    they first appear: at least two good rollouts whose rewards (as shaped) differ."""
    groups = [r.problem_id for r in rollouts]
    keep, _ = good_rollouts([r.error is not None for r in rollouts], groups)
    good = [rollouts[i] for i in keep]
    live = signal_groups(shaped_rewards(good, spec), [r.problem_id for r in good])
    return [g for g in dict.fromkeys(groups) if g in live]


async def dynamic_sampling(
    rollouts: list[Rollout],
    more: Callable[[int], Awaitable[list[Rollout]]],
    spec: RunSpec,
) -> tuple[list[Rollout], list[Rollout], dict[str, float]]:
    """While the step has fewer than `train.problems_per_step` groups with signal,
    `more(n)` runs n further problems (the next ones in the data order), at most
    `grpo.dynamic_sampling_rounds` times. Returns every rollout gathered, those of the
    first problems_per_step groups with signal (what trains), and the step's record of it."""
    target = spec.train.problems_per_step
    rounds = 0
    live = groups_with_signal(rollouts, spec)
    while len(live) < target and rounds < spec.grpo.dynamic_sampling_rounds:
        rollouts = rollouts + await more(target - len(live))
        rounds += 1
        live = groups_with_signal(rollouts, spec)
    kept = set(live[:target])
    sampled = len({r.problem_id for r in rollouts})
    return (
        rollouts,
        [r for r in rollouts if r.problem_id in kept],
        dynamic_sampling_metrics(sampled, len(live), rounds, len(kept)),
    )
