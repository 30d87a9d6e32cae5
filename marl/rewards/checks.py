"""Submit-time checks of a run's reward settings, each a SpecError naming the field."""

from __future__ import annotations

from marl.rewards import functions
from marl.spec.run import RunSpec, SpecError


def check_reward(spec: RunSpec) -> None:
    """`reward.function` resolves and takes `reward.args`; `reward.args` without a function
    is refused (the built-in rewards take none)."""
    reward = spec.reward
    if reward.function is None:
        if reward.args:
            raise SpecError("field `reward.args`: arguments for a reward function, and "
                            "reward.function is unset; set it, or remove reward.args")
        return
    functions.check(reward.function, reward.args)
    if reward.judge is None and reward.function == functions.BUILTIN_JUDGE:
        raise SpecError(f"field `reward.judge`: {functions.BUILTIN_JUDGE} needs reward.judge "
                        "(who judges, and how)")
