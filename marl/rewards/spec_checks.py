"""Submit-time checks of a run's reward settings, each a SpecError naming the field."""

from __future__ import annotations

from marl.rewards import functions
from marl.spec.run import RunSpec, SpecError
from marl.spec.safe_input import shorten


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
    if reward.judge is None and functions.BUILTIN.get(
            reward.function, reward.function) == functions.BUILTIN_JUDGE:
        raise SpecError(f"field `reward.judge`: {functions.BUILTIN_JUDGE} needs reward.judge "
                        "(who judges, and how)")


def check_judge_endpoint(endpoint: str, allowed: list[str], setting: str) -> None:
    """`reward.judge.endpoint` is one the operator listed (`judge_endpoints`): the workers
    send the judge's API key there, and a spec must not point them at any server it likes.
    URLs compare without a trailing slash."""
    listed = {url.rstrip("/") for url in allowed}
    if endpoint.rstrip("/") not in listed:
        raise SpecError(
            f"field `reward.judge.endpoint`: {shorten(endpoint)} is not one of the judge "
            f"endpoints this deployment allows ({', '.join(sorted(listed)) or 'none'}); leave "
            f"it unset to judge on the run's own inference, or have the operator add it to "
            f"{setting}"
        )
