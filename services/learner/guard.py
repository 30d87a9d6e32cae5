"""The cliff guard: what a fired alarm does to the run (`guard.on_alarm` in the RunSpec).

warn logs the alarm; stop ends the run FAILED naming it; rollback loads every adapter,
its optimizer and its schedule back from the best checkpoint (`checkpoints/best`, the
latest one before any validation) and lowers the learning rate of each adapter to its
configured rate times `rollback_lr_factor` per rollback so far. Data keep moving
forward: the rolled-back adapters meet problems they have not seen. After
`max_rollbacks` rollbacks, a rollback alarm stops the run instead.

split (`sp_role_capture` only) is adaptive policy sharing, the paper's closing question
(§6): the captured role leaves the shared adapter for one of its own, a copy of the shared
one at that step, AdamW moments and step count and learning-rate schedule included, and
the run trains on with that routing, every other role still sharing. So that no second
model is built mid-run (and FSDP shards every adapter alike), the policy is built with one
untrained spare adapter per role that could be split off (`spare_adapters`); a split
copies the shared adapter into the role's spare. The routing travels in the checkpoint
(`state.json`'s `routing`), so a resumed run trains on with it; metrics.jsonl's record of
the step names the split (`guard`, `routing`), and the run record lists it with the alarms.
A role already on an adapter of its own is not split again.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from marl.diagnostics.alarms import Alarm
from marl.spec.run import RunSpec
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
    kind: Literal["stop", "rollback", "split"]
    alarm: Alarm
    why: str


def acts(spec: RunSpec) -> bool:
    """Whether some alarm makes the guard do more than warn."""
    return any(action != "warn" for action in spec.guard.on_alarm.values())


def spare_adapters(spec: RunSpec, roles: dict[str, str]) -> dict[str, str]:
    """Role -> the adapter it gets if it is split off: with `guard.on_alarm.sp_role_capture:
    split`, one for every role on an adapter that serves several (named after the role, or
    `<role>-own` where an adapter already has that name); else none."""
    if spec.guard.on_alarm.get("sp_role_capture") != "split":
        return {}
    served = Counter(roles.values())
    taken = set(roles.values())
    return {
        role: role if role not in taken else f"{role}-own"
        for role, adapter in sorted(roles.items())
        if served[adapter] > 1
    }


def copy_adapter(policy: MultiAdapterPolicy, source: str, target: str) -> None:
    """The split's copy, where the policy lives (`PolicyHandle.call`)."""
    policy.copy_adapter(source, target)


class Guard:
    def __init__(self, spec: RunSpec, rollbacks: int = 0, spares: dict[str, str] | None = None):
        self.spec = spec
        self.rollbacks = rollbacks
        """Rollbacks done so far in this run (kept in its checkpoints)."""
        self.spares = spares or {}
        """Role -> the adapter a split gives it (`spare_adapters`)."""

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
        for alarm in fired:
            if actions.get(alarm.mechanism) == "split" and alarm.role in self.spares:
                return Action("split", alarm, f"guard.on_alarm.{alarm.mechanism}=split")
        return None

    def split(self, policy: PolicyHandle, roles: dict[str, str], role: str) -> str | None:
        """Give `role` its own adapter, a copy of its shared one now; `roles` (role ->
        adapter) changes in place. What was done, in words, or None when the role has an
        adapter of its own already."""
        source = roles[role]
        if list(roles.values()).count(source) < 2:
            return None
        target = self.spares[role]
        policy.call(copy_adapter, source, target)
        roles[role] = target
        return f"role {role} on adapter {target}, a copy of {source} (optimizer state copied)"

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
