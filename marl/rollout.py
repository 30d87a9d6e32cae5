"""Tasks the learner enqueues and rollouts the workers return: plain JSON data."""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass, field, fields, is_dataclass
from typing import TYPE_CHECKING, Any, Literal

from marl.problem import Problem

if TYPE_CHECKING:
    from marl.spec.run import RunSpec

Kind = Literal["train", "val"]


@dataclass
class AdapterRef:
    name: str
    """`run/policy`."""
    version: int


@dataclass
class Task:
    run_id: str
    step: int
    kind: Kind
    problem: Problem
    sample: int
    """Index within the problem's group."""
    workflow: str
    adapters: dict[str, AdapterRef]
    """Role -> the adapter version that serves it."""
    model_path: str
    """Base model directory (the worker reads its tokenizer)."""
    temperature: float
    top_p: float
    max_tokens: int
    caps: dict[str, int] = field(default_factory=dict)
    format_penalty: float = -0.1
    math_timeout_s: float = 5.0
    seed: int = 0
    """The run's seed; each turn's sampling seed is derived from it and the task (see
    `services/workflow/episode_runtime.py`), so a rerun samples the same tokens on the
    same engine."""
    chat_template: bool = True
    """`model.chat_template`: render prompts with the tokenizer's chat template."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """`model.chat_template_kwargs`, passed to the chat template (e.g. enable_thinking)."""
    staleness_scope: str = "episode"
    """`train.staleness_scope`: `turn` asks each turn for the newest adapter version a
    replica holds (at least `adapters`'), `episode` for exactly `adapters`."""
    reward_function: str | None = None
    """`reward.function` (None: the built-in reward of the problem's task, or the judge's)."""
    reward_args: dict[str, Any] = field(default_factory=dict)
    """`reward.args`, keyword arguments of the reward function."""
    judge: dict[str, Any] | None = None
    """`reward.judge` (a JudgeSpec's fields), when the run has a judge."""
    workflow_args: dict[str, Any] = field(default_factory=dict)
    """`workflow_args`, validated by the workflow's own model in each episode."""

    @property
    def id(self) -> str:
        """Deterministic: a re-run of the same task gets the same id (de-duplication)."""
        return f"{self.run_id}:{self.kind}:{self.step}:{self.problem.id}:{self.sample}"

    def to_dict(self) -> dict[str, Any]:
        return _plain(self)  # type: ignore[no-any-return]

    @classmethod
    def for_spec(
        cls,
        spec: RunSpec,
        run_id: str,
        problem: Problem,
        step: int,
        kind: Kind,
        sample: int,
        adapters: dict[str, AdapterRef],
    ) -> Task:
        """The task a run's spec makes for one (problem, sample): everything a worker needs
        from the spec travels in it (sampling, caps, reward settings, seed, chat template)."""
        from marl.spec.run import response_cap

        return cls(
            run_id=run_id,
            step=step,
            kind=kind,
            problem=problem,
            sample=sample,
            workflow=spec.workflow,
            adapters=adapters,
            model_path=spec.model.path,
            temperature=spec.sampling.temperature
            if kind == "train"
            else spec.sampling.validation_temperature,
            top_p=spec.sampling.top_p,
            max_tokens=response_cap(spec),
            caps=spec.caps.model_dump(),
            format_penalty=spec.reward.format_penalty,
            math_timeout_s=spec.reward.math_timeout_s,
            seed=spec.seed,
            chat_template=spec.model.chat_template,
            chat_template_kwargs=dict(spec.model.chat_template_kwargs),
            staleness_scope=spec.train.staleness_scope if kind == "train" else "episode",
            reward_function=spec.reward.function,
            reward_args=dict(spec.reward.args),
            judge=None if spec.reward.judge is None else spec.reward.judge.model_dump(),
            workflow_args=dict(spec.workflow_args),
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Task:
        d = dict(d)
        d["problem"] = Problem.from_dict(d["problem"])
        d["adapters"] = {role: AdapterRef(**ref) for role, ref in d["adapters"].items()}
        return cls(**d)


@dataclass
class Turn:
    role: str
    slot: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    adapter: AdapterRef
    """The version that actually served this turn (as the inference replica reported it)."""
    text: str
    tool_calls: int = 0
    """Tool calls this turn's completion made (marl/workflows/tools.py); their results are
    prompt tokens of the role's next turn, so never in the loss."""
    tool_errors: int = 0
    """Of those, the calls answered with an error (malformed, unknown tool, raised, timed
    out)."""


@dataclass
class Rollout:
    task_id: str
    run_id: str
    step: int
    kind: Kind
    problem_id: str
    sample: int
    turns: list[Turn]
    final_text: str
    reward: float
    worker_id: str = ""
    seconds: float = 0.0
    error: str | None = None
    """Set when the episode could not run (no replica, sandbox down): not a score."""
    facts: dict[str, float] = field(default_factory=dict)
    """Numbers the worker observed about the episode (workflow facts, scoring facts such as
    `any_format_correct`); the learner logs each one's mean as `train/<fact>` and `val/<fact>`."""
    role_rewards: dict[str, float] = field(default_factory=dict)
    """Rewards of single roles (from the workflow or the reward function); a role not named
    gets `reward`. Set: the learner normalises each role's advantages over its own rewards
    (services/learner/advantages.py)."""
    judge_turns: list[Turn] = field(default_factory=list)
    """The judge's turns when no policy group names the judge role: recorded, not trained."""

    def to_dict(self) -> dict[str, Any]:
        return _plain(self)  # type: ignore[no-any-return]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Rollout:
        d = dict(d)
        d["turns"] = [Turn(**{**t, "adapter": AdapterRef(**t["adapter"])}) for t in d["turns"]]
        d["judge_turns"] = [Turn(**{**t, "adapter": AdapterRef(**t["adapter"])})
                            for t in d.get("judge_turns", [])]
        return cls(**d)


_ATOMS = (str, int, float, bool, type(None))


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def json_fields(value: Any) -> dict[str, Any]:
    """For `json.dumps(..., default=json_fields)`: a dataclass as its fields, which the
    encoder then writes, so a Task or a Rollout comes out as its `to_dict()` would, without
    that dict built first (the encoder, in C, walks the fields itself)."""
    if is_dataclass(value) and not isinstance(value, type):
        return {name: getattr(value, name) for name in _field_names(type(value))}
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def to_json(value: Task | Rollout) -> str:
    """`json.dumps(value.to_dict())`, in about half the time."""
    return json.dumps(value, default=json_fields)


def _plain(value: Any) -> Any:
    """`dataclasses.asdict` for this module's JSON data, without its deep copy of every
    leaf: a step's tasks and rollouts are serialised several times over (tasks by the
    learner; rollouts by the worker and the learner's rollout log), and asdict took most
    of that time."""
    if isinstance(value, _ATOMS):
        return value
    if is_dataclass(value) and not isinstance(value, type):
        return {name: _plain(getattr(value, name)) for name in _field_names(type(value))}
    if isinstance(value, list | tuple):
        return type(value)(v if isinstance(v, _ATOMS) else _plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return copy.deepcopy(value)  # as asdict does


def mean_facts(rollouts: list[Rollout], prefix: str) -> dict[str, float]:
    """`prefix/<fact>`: each fact's mean over the rollouts that report it (failed ones excluded).
    A per-role fact (`role/<r>/<name>`, e.g. `role/solver/tool_errors`) keeps its name in
    training records, as the learner's per-role metrics do."""
    sums: dict[str, list[float]] = {}
    for r in rollouts:
        if r.error is None:
            for name, value in r.facts.items():
                sums.setdefault(name, []).append(value)
    return {
        name if prefix == "train" and name.startswith("role/") else f"{prefix}/{name}":
        sum(v) / len(v) for name, v in sorted(sums.items())
    }
