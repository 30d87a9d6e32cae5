"""How a run went, honestly: its failed episodes and steps, and whether they fail the run.

An episode fails when it cannot be played (no inference replica, the sandbox down, a
prompt over its cap, a task dead-lettered); it is left out of its group, so a step can
train on the few episodes that survived. A step whose share of failed episodes is above
`train.max_failed_fraction` is a *failed step* (`train/failed_step` 1 in its record).

The run record (GetRun, `marl status`) keeps `steps_done`, `failed_steps`, `episodes` and
`failed_episodes`. A run that trains its last step with more than `train.max_failed_steps`
of its steps failed ends FAILED, its error giving the counts; its checkpoints and metrics
stay. (Steps whose every episode failed end the run at once, `FAILED_STEPS_LIMIT` in a row:
trainer.py.) The counts are read from the logged records (`train/episodes`,
`train/episode_errors`, `train/failed_step`), so a resumed run counts each kept step once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from marl.spec.run import TrainSpec


def step_failed(episodes: int, failed: int, max_failed_fraction: float) -> bool:
    """Whether a step with `failed` of its `episodes` failed counts as a failed step."""
    return episodes > 0 and failed / episodes > max_failed_fraction


@dataclass
class Outcome:
    steps_done: int = 0
    """Training steps logged (each with its `train/episodes`)."""
    failed_steps: int = 0
    episodes: int = 0
    failed_episodes: int = 0

    def note(self, record: dict[str, Any]) -> None:
        """Count a logged record; validation-only records (step 0) count nothing."""
        if "train/episodes" not in record:
            return
        self.add(
            int(record["train/episodes"]),
            int(record.get("train/episode_errors", 0)),
            bool(record.get("train/failed_step", 0)),
        )

    def add(self, episodes: int, failed: int, failed_step: bool) -> None:
        self.steps_done += 1
        self.failed_steps += int(failed_step)
        self.episodes += episodes
        self.failed_episodes += failed

    def fields(self) -> dict[str, int]:
        """The run record's fields."""
        return asdict(self)

    def verdict(self, train: TrainSpec) -> str | None:
        """Why the run fails at its end (None: it does not)."""
        if not self.steps_done or self.failed_steps <= train.max_failed_steps * self.steps_done:
            return None
        return (
            f"{self.failed_steps} of {self.steps_done} steps failed (each lost more than "
            f"train.max_failed_fraction={train.max_failed_fraction:g} of its episodes), more "
            f"than train.max_failed_steps={train.max_failed_steps:g} of them; "
            f"{self.failed_episodes} of {self.episodes} episodes failed: see the workers' "
            "logs and `train/episode_errors` in metrics.jsonl"
        )
