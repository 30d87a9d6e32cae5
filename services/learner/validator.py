"""Validation through the same workflow path as training: when it is due, and what it logs.

With `train.val_pass_at` every problem is sampled max(k) times and `val/pass@k` is the
unbiased pass@k (grpo.pass_at_k), a sample passing when its reward is 1 (fully correct);
`val/accuracy` is then the mean reward over every sample.
"""

from __future__ import annotations

from typing import Any

from marl.diagnostics.signatures import role_signatures
from marl.problem import Problem
from marl.rollout import Rollout, mean_facts
from services.learner.episodes import Episodes
from services.learner.grpo import pass_at_k


class Validator:
    """Runs at step 0, every `interval` steps and at the last step."""

    def __init__(
        self, problems: list[Problem], interval: int, total_steps: int, episodes: Episodes
    ):
        self.problems = problems
        self.interval = interval
        self.total_steps = total_steps
        self.episodes = episodes

    def due(self, step: int) -> bool:
        return step == 0 or step % self.interval == 0 or step == self.total_steps

    async def run(self, step: int) -> dict[str, Any]:
        ks = self.episodes.spec.train.val_pass_at
        rollouts = await self.episodes.run(self.problems, step, "val", max(ks, default=1))
        rewards = [min(max(r.reward, 0.0), 1.0) for r in rollouts]
        read = {p.id for p in self.problems[: self.episodes.spec.train.signature_problems]}
        return {
            **pass_at(rollouts, ks),
            "val/accuracy": sum(rewards) / max(len(rewards), 1),
            "val/problems": len({r.problem_id for r in rollouts}),
            "val/episode_errors": sum(r.error is not None for r in rollouts),
            **mean_facts(rollouts, "val"),
            # the paper reads role drift on each checkpoint's validation transcripts of 100
            # problems (§A.3-A.4): the same first problems at every validation
            "val/signature_problems": len(read),
            **{
                f"val/{k}": v
                for k, v in role_signatures([r for r in rollouts if r.problem_id in read],
                                            self.episodes.spec.workflow).items()
            },
        }


def pass_at(rollouts: list[Rollout], ks: list[int]) -> dict[str, float]:
    """`val/pass@k` for each k: the mean over problems of the unbiased pass@k of their
    samples (failed episodes left out; a problem left with fewer than k is too)."""
    passed: dict[str, list[bool]] = {}
    for r in rollouts:
        if r.error is None:
            passed.setdefault(r.problem_id, []).append(r.reward >= 1.0)
    out = {}
    for k in ks:
        scores = [pass_at_k(len(p), sum(p), k) for p in passed.values() if len(p) >= k]
        out[f"val/pass@{k}"] = sum(scores) / max(len(scores), 1)
    return out
