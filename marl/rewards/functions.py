"""Reward functions by name: `reward.function: pkg.module:fn`, sync or async.

Two signatures are understood, told apart by the parameter names:

- marl's: `fn(problem, answer, episode, **reward.args)`: the `Problem` (prompt,
  answer, tests, `messages`, `data_source`, `extra_info`), the workflow's final
  answer, and the episode (`episode.turns`: every role turn with its text and
  token ids; `episode.facts`; `episode.task`; `episode.sandbox()`: the reward
  sandbox client; `episode.judge(messages)`: the run's judge, see
  marl/rewards/llm_judge.py).
- verl's: `compute_score(data_source, solution_str, ground_truth, extra_info=None,
  **reward.args)` (verl's `custom_reward_function`), called unchanged with the
  problem's `data_source`, the final answer, the ground truth and `extra_info`.

Either returns a number or a mapping `{"score": x, **components}`: numeric
components are logged as metrics (`train/<name>`, `val/<name>`), others (verl's
`pred` strings) are dropped. `{"role_rewards": {role: x}}` gives roles their own
rewards (the learner then normalises each role's advantages over its own
rewards, services/learner/advantages.py). A sync function runs in a thread,
so a slow one does not stall the worker's other episodes.

A function that raises, or returns NaN, infinity or no number, fails that
rollout (`RewardError`, named with the function): it is left out of its group and
counted in `train/episode_errors`; a run whose every rollout fails this way ends
FAILED with that error. The default (`reward.function` unset) is the built-in math
or code reward by the problem's task (marl/rewards/builtin.py), as before.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from marl.problem import Problem
from marl.spec import code_refs
from marl.spec.code_refs import CodePolicy
from marl.spec.run import SpecError

BUILTIN_MATH = "marl.rewards.builtin:math_reward"
BUILTIN_CODE = "marl.rewards.builtin:code_reward"
BUILTIN_JUDGE = "marl.rewards.llm_judge:judge_reward"
VERL_PARAMS = ("data_source", "solution_str", "ground_truth")


class RewardError(RuntimeError):
    """A reward function failed on one episode (raised, or gave no finite number): the
    rollout is failed, not scored."""


@dataclass
class Scored:
    """What a reward function gave one episode."""

    score: float
    components: dict[str, float] = field(default_factory=dict)
    role_rewards: dict[str, float] = field(default_factory=dict)


BUILTIN: dict[str, str] = {
    "math_reward": BUILTIN_MATH,
    "any_format_reward": "marl.rewards.builtin:any_format_reward",
    "code_reward": BUILTIN_CODE,
    "judge_reward": BUILTIN_JUDGE,
}
"""marl's reward functions: a spec may name them by these names or by `module:function`."""


def check_name(name: str, policy: CodePolicy, field_name: str = "reward.function") -> None:
    """A SpecError naming the field unless `policy` lets a spec name `name` (no import)."""
    policy.target(name, "reward", field_name, BUILTIN)


@functools.lru_cache(maxsize=32)
def resolve(name: str, field_name: str = "reward.function",
            policy: CodePolicy | None = None) -> Callable[..., Any]:
    """The function `name` names (a built-in's or an entry point's name, or
    `pkg.module:fn`); with `policy`, only one it allows. A SpecError naming the field when
    it is not allowed, not importable or not callable."""
    if policy is not None:
        target = policy.target(name, "reward", field_name, BUILTIN)
    else:
        target = BUILTIN.get(name) or code_refs.entry_points(
            code_refs.GROUPS["reward"]).get(name, name)
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise SpecError(f"field `{field_name}`: {name!r} must be `package.module:function`")
    fn = code_refs.load(target, field_name, "function ")
    if not callable(fn):
        raise SpecError(f"field `{field_name}`: module {module_name!r} has no function {attr!r}")
    return fn  # type: ignore[no-any-return]


def is_verl(fn: Callable[..., Any]) -> bool:
    """Whether `fn` has verl's `compute_score(data_source, solution_str, ground_truth, ...)`."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return all(p in params for p in VERL_PARAMS)


def check(name: str, args: Mapping[str, Any]) -> None:
    """Submit-time: the function resolves and takes `args` (reward.args)."""
    fn = resolve(name)
    try:
        sig = code_refs.guarded("reward.function", "reading its signature",
                                lambda: inspect.signature(fn))
    except SpecError:
        return  # no signature to read (a builtin, a C function): the call will tell
    if is_verl(fn):
        fixed: tuple[str, ...] = (*VERL_PARAMS, "extra_info")
    else:
        fixed = ("problem", "answer", "episode")
    try:
        sig.bind_partial(**{p: None for p in fixed if p in sig.parameters}, **args)
    except TypeError as err:
        raise SpecError(f"field `reward.args`: {name} does not take them ({err})") from None


async def call(
    name: str, problem: Problem, answer: str, episode: Any, args: Mapping[str, Any]
) -> Scored:
    """Score one episode with the function `name`; RewardError when it fails."""
    fn = resolve(name)
    try:
        verl, takes_extra_info = _convention(fn)
    except TypeError:  # an unhashable callable: read every time
        verl, takes_extra_info = _convention.__wrapped__(fn)
    if verl:
        kwargs: dict[str, Any] = dict(data_source=problem.data_source, solution_str=answer,
                                      ground_truth=problem.answer, extra_info=problem.extra_info)
        if not takes_extra_info:
            del kwargs["extra_info"]
        bound = functools.partial(fn, **kwargs, **args)
    else:
        bound = functools.partial(fn, problem, answer, episode, **args)
    try:
        if inspect.iscoroutinefunction(fn):
            result = await bound()
        else:
            result = await asyncio.to_thread(bound)
            if inspect.isawaitable(result):
                result = await result
    except (RewardError, asyncio.CancelledError):
        raise
    except BaseException as err:  # noqa: B036 - the user's function, SystemExit included:
        # its failure fails this rollout only, never the worker
        raise RewardError(f"reward function {name} raised {type(err).__name__}: {err}") from err
    return parse(result, name)


@functools.lru_cache(maxsize=256)
def _convention(fn: Callable[..., Any]) -> tuple[bool, bool]:
    """Whether `fn` has verl's signature, and takes `extra_info`; read once per function:
    `inspect.signature` costs a worker more than a math reward's scoring, every episode."""
    if not is_verl(fn):
        return False, False
    return True, "extra_info" in inspect.signature(fn).parameters or _takes_kwargs(fn)


def _takes_kwargs(fn: Callable[..., Any]) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD
               for p in inspect.signature(fn).parameters.values())


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    try:  # numpy and torch scalars
        return float(value.item())
    except (AttributeError, TypeError, ValueError):
        return None


def parse(result: Any, name: str) -> Scored:
    """A function's return value as a score, its numeric components and role rewards."""
    if isinstance(result, Mapping):
        if "score" not in result:
            raise RewardError(f"reward function {name} returned a mapping without `score` "
                              f"(keys: {', '.join(map(str, result))})")
        score = _number(result["score"])
        components = {str(k): v for k, v in ((k, _number(v)) for k, v in result.items()
                                             if k not in ("score", "role_rewards"))
                      if v is not None and math.isfinite(v)}
        roles = result.get("role_rewards") or {}
        if not isinstance(roles, Mapping):
            raise RewardError(f"reward function {name}: `role_rewards` must map role -> number")
        role_rewards = {}
        for role, value in roles.items():
            number = _number(value)
            if number is None or not math.isfinite(number):
                raise RewardError(f"reward function {name} gave role {role!r} the reward "
                                  f"{value!r}, not a finite number")
            role_rewards[str(role)] = number
    else:
        score, components, role_rewards = _number(result), {}, {}
    if score is None or not math.isfinite(score):
        shown = result["score"] if isinstance(result, Mapping) else result
        raise RewardError(f"reward function {name} returned {shown!r}, not a finite number")
    return Scored(score, components, role_rewards)


def default_for(task: str) -> str:
    """The built-in reward function of a task."""
    return BUILTIN_CODE if task == "code" else BUILTIN_MATH
