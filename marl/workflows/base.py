"""What a workflow is, and what it may ask of the episode it runs in.

A workflow is plain code: `async def run(episode, problem) -> str` that calls
`await episode.turn(role, slot, messages)` for each role turn (or
`episode.tool_turn(...)` for one that may call tools) and returns the final
answer. Its arguments (`workflow_args` in the spec) come validated by its own
pydantic model as `episode.args`. Everything else (the chat template, which adapter version serves
a role, the seeds, recording tokens and log-probs, scoring) is the runtime's
(`services/workflow`), so the same `Workflow` value runs in a worker, in a test
against a scripted engine, and in `marl episode`.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ValidationError

from marl.problem import Problem
from marl.spec.run import WorkflowCaps

Messages = list[dict[str, str]]
TaskName = Literal["math", "code"]
ROLE_PATTERN = re.compile(r"^[a-z][a-z0-9_]{0,31}$")

PAPER_PROMPT_TOKENS = {"math": 20480, "code": 10240}
"""Table 7's prompt caps for Voting and Orch-Workers (Eval-Opt has its own, longer one)."""


class EpisodeError(RuntimeError):
    """This episode could not run (no replica, inference unreachable, a prompt over its cap,
    the sandbox down): the rollout is returned as failed and left out of training. A bug is
    not an EpisodeError."""


@dataclass(frozen=True)
class Caps:
    """One workflow's limits on one task, taken from the RunSpec's `caps` section."""

    prompt_tokens: int
    """A rendered role prompt longer than this ends the episode as a failed one."""
    rounds: int = 0
    """Eval-Opt: revision rounds at most."""
    parallel: int = 1
    """Voting: candidates; Orch-Workers: workers."""
    extra: Mapping[str, int] = field(default_factory=dict)
    """A user workflow's own caps (its defaults, see `Workflow.caps`)."""


def prompt_cap(caps: WorkflowCaps, task: TaskName, paper: Mapping[str, int]) -> int:
    """The spec's prompt cap for the task, or the paper's for this workflow when unset (0)."""
    spec = caps.prompt_tokens_code if task == "code" else caps.prompt_tokens_math
    return spec or paper[task]


class Episode(Protocol):
    """What a workflow can use. `turn` is the only way to call a model."""

    @property
    def caps(self) -> Caps: ...

    @property
    def facts(self) -> dict[str, float]:
        """Numbers about this episode, logged as `train/<name>` and `val/<name>` (means)."""
        ...

    async def turn(self, role: str, slot: int, messages: Messages) -> str:
        """One role turn: served by the role's adapter, recorded for training; the text."""
        ...

    async def correct(self, answer: str) -> bool:
        """Whether `answer` would earn full reward (the oracle, for facts only: a workflow
        must not use it to decide what to do)."""
        ...

    async def openai_base_url(self) -> str:
        """An OpenAI-compatible base URL for agent code written against the `openai`
        client: `model` names a role (`role:slot` for a parallel slot) and every chat
        call is that role's `turn` (examples/workflows/openai_agent.py)."""
        ...

    @property
    def args(self) -> Any:
        """The run's `workflow_args` as the workflow's own model (`Workflow.args`) made
        them; None when the workflow takes none."""
        ...

    @property
    def role_rewards(self) -> dict[str, float]:
        """Rewards of single roles the workflow sets (`role_rewards["checker"] = 1.0`); a
        role not named gets the episode's reward, and the learner normalises each role's
        advantages over its own rewards."""
        ...

    async def tool_turn(self, role: str, slot: int, messages: Messages, tools: Any,
                        max_tool_calls: int | None = None) -> str:
        """A role turn that may call tools (marl/workflows/tools.py): the model's calls run,
        their results come back as tool messages, until it answers without a call or has
        made `max_tool_calls`. Each model call is a recorded turn; the text of the last."""
        ...

    async def judge(self, messages: Messages) -> str:
        """The run's judge (`reward.judge`) answers `messages`; its turn is recorded, and
        trained only when a policy group names the judge role (marl/rewards/llm_judge.py)."""
        ...


RunFn = Callable[[Any, Problem], Awaitable[str]]


def default_caps(defaults: Mapping[str, int]) -> Callable[[WorkflowCaps, TaskName], Caps]:
    """Caps for a user workflow: the paper's Voting prompt caps and its own `caps` defaults."""

    def caps(spec: WorkflowCaps, task: TaskName) -> Caps:
        return Caps(prompt_tokens=prompt_cap(spec, task, PAPER_PROMPT_TOKENS), extra=defaults)

    return caps


@dataclass(frozen=True)
class Workflow:
    """A named workflow: its roles, how it runs, and its caps.

    `run(episode, problem)` returns the final answer, which is scored. `caps` is
    either a mapping of the workflow's own integer limits (read as
    `episode.caps.extra[name]`) or a function from the RunSpec's caps and the task
    to `Caps` (the built-in workflows)."""

    name: str
    roles: tuple[str, ...]
    run: RunFn
    caps: Mapping[str, int] | Callable[[WorkflowCaps, TaskName], Caps] = field(
        default_factory=dict
    )
    args: type[BaseModel] | None = None
    """A pydantic model of the workflow's arguments (the spec's `workflow_args`): checked
    when the run is submitted, a bad value refused naming `workflow_args.<field>`; the
    episode gets the validated instance as `episode.args`."""

    def __post_init__(self) -> None:
        if not isinstance(self.roles, tuple) or not self.roles:
            raise ValueError(f"Workflow {self.name!r}: roles must be a non-empty tuple of names")
        bad = [r for r in self.roles if not isinstance(r, str) or not ROLE_PATTERN.match(r)]
        if bad:
            raise ValueError(
                f"Workflow {self.name!r}: role names {bad} must be lowercase identifiers "
                "(they name adapters)"
            )
        if len(set(self.roles)) != len(self.roles):
            raise ValueError(f"Workflow {self.name!r}: roles {self.roles} repeat a name")
        if not callable(self.run):
            raise ValueError(f"Workflow {self.name!r}: run must be an async function")
        if self.args is not None and not (
                isinstance(self.args, type) and issubclass(self.args, BaseModel)):
            raise ValueError(f"Workflow {self.name!r}: args must be a pydantic model class")

    def parse_args(self, values: Mapping[str, Any]) -> BaseModel | None:
        """`workflow_args` as this workflow's model; a SpecError naming the field."""
        from marl.spec.run import SpecError

        if self.args is None:
            if values:
                raise SpecError(
                    f"field `workflow_args`: workflow {self.name!r} takes no arguments "
                    f"(got {', '.join(sorted(values))}); remove them"
                )
            return None
        try:
            return self.args.model_validate(dict(values))
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            what = ("unknown field: remove it or check the spelling"
                    if first["type"] == "extra_forbidden" else first["msg"])
            raise SpecError(
                f"field `workflow_args.{where}`: {what}"
                + (f" (got {first['input']!r})" if first["type"] != "extra_forbidden" else "")
            ) from None
        except (Exception, SystemExit, KeyboardInterrupt) as err:  # the workflow's validators
            raise SpecError(
                f"field `workflow_args`: {self.args.__name__} raised {type(err).__name__} "
                f"validating them: {str(err)[:300]}"
            ) from None

    def caps_for(self, spec: WorkflowCaps, task: TaskName) -> Caps:
        if callable(self.caps):
            return self.caps(spec, task)
        return default_caps(self.caps)(spec, task)
