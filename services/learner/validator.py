"""Validation through the same workflow path as training: when it is due, and what it logs."""

from __future__ import annotations

from typing import Any

from marl.data.problem import Problem
from marl.diagnostics.signatures import role_signatures
from marl.rollout import mean_facts
from services.learner.episodes import Episodes


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
        rollouts = await self.episodes.run(self.problems, step, "val")
        rewards = [min(max(r.reward, 0.0), 1.0) for r in rollouts]
        return {
            "val/accuracy": sum(rewards) / max(len(rewards), 1),
            "val/problems": len(rollouts),
            "val/episode_errors": sum(r.error is not None for r in rollouts),
            **mean_facts(rollouts, "val"),
            # the paper reads role drift on each checkpoint's validation transcripts (§A.3-A.4)
            **{
                f"val/{k}": v
                for k, v in role_signatures(rollouts, self.episodes.spec.workflow).items()
            },
        }
