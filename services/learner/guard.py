"""The cliff guard: what a fired alarm does to the run (`guard.on_alarm` in the RunSpec).

warn logs the alarm; stop ends the run FAILED naming it; rollback loads every adapter,
its optimizer and its schedule back from the best checkpoint (`checkpoints/best`, the
latest one before any validation) and lowers the learning rate of each adapter to its
configured rate times `rollback_lr_factor` per rollback so far. Data keep moving
forward: the rolled-back adapters meet problems they have not seen. After
`max_rollbacks` rollbacks, a rollback alarm stops the run instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from marl.config import RunSpec
from marl.diagnostics.alarms import Alarm
from services.learner import checkpoint
from services.learner.checkpoint import Checkpointer
from services.learner.errors import RunFailed

if TYPE_CHECKING:
    from services.learner.policy import MultiAdapterPolicy
    from services.learner.ranks import PolicyHandle


class GuardStopped(RunFailed):
    """The guard ended the run at an alarm (the message names it)."""

    def __init__(self, alarm: Alarm, why: str = "guard.on_alarm"):
        super().__init__(f"stopped by {why}: {alarm}")


@dataclass(frozen=True)
class Action:
    kind: Literal["stop", "rollback"]
    alarm: Alarm
    why: str


class Guard:
    def __init__(self, spec: RunSpec, rollbacks: int = 0):
        self.spec = spec
        self.rollbacks = rollbacks
        """Rollbacks done so far in this run (kept in its checkpoints)."""

    def decide(self, fired: list[Alarm]) -> Action | None:
        """The action the first alarm that asks for one calls for; stop wins."""
        actions = {str(k): v for k, v in self.spec.guard.on_alarm.items()}
        for alarm in fired:
            if actions.get(alarm.mechanism) == "stop":
                return Action("stop", alarm, f"guard.on_alarm.{alarm.mechanism}=stop")
        for alarm in fired:
            if actions.get(alarm.mechanism) == "rollback":
                if self.rollbacks >= self.spec.guard.max_rollbacks:
                    why = (
                        f"guard.on_alarm.{alarm.mechanism}=rollback after "
                        f"guard.max_rollbacks={self.spec.guard.max_rollbacks} rollbacks"
                    )
                    return Action("stop", alarm, why)
                return Action("rollback", alarm, f"guard.on_alarm.{alarm.mechanism}=rollback")
        return None

    def roll_back(self, policy: PolicyHandle, checkpointer: Checkpointer) -> str | None:
        """Load the best checkpoint and lower every learning rate; what was done, in words,
        or None when the run has no checkpoint yet."""
        source = checkpointer.root / "best"
        if not source.exists():
            latest = checkpointer.root / "latest"
            if not latest.exists():
                return None
            source = checkpointer.root / latest.read_text().strip()
        state = checkpoint.load(source, policy)
        self.rollbacks += 1
        factor = self.spec.guard.rollback_lr_factor**self.rollbacks
        targets = {
            name: self.spec.optim.policy_lr.get(name, self.spec.optim.lr) * factor
            for name in policy.policies
        }
        policy.call(set_learning_rates, targets)
        accuracy = state.get("val_accuracy")
        at = "" if accuracy is None else f" (validation accuracy {accuracy:.3f})"
        return (
            f"adapters back to step {state['step']}{at}, learning rate x{factor:g} "
            f"(rollback {self.rollbacks} of {self.spec.guard.max_rollbacks})"
        )


def set_learning_rates(policy: MultiAdapterPolicy, targets: dict[str, float]) -> None:
    """Each adapter's peak learning rate becomes its target; the schedule goes on from
    where it is."""
    for name, target in targets.items():
        scheduler = policy.schedulers[name]
        scheduler.base_lrs = [target for _ in scheduler.base_lrs]
        groups = policy.optimizers[name].param_groups
        for group, scale in zip(groups, scheduler.lr_lambdas, strict=True):
            group["lr"] = target * scale(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in groups]  # type: ignore[attr-defined]
