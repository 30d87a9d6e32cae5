"""The unit of work a workflow solves: one problem with its ground truth."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

TaskKind = Literal["math", "code"]


@dataclass(frozen=True)
class Problem:
    id: str
    """Stable id within its dataset (used for deterministic rollout ids)."""
    prompt: str
    """The problem statement every role sees."""
    answer: str = ""
    """Ground-truth final answer (math)."""
    task: TaskKind = "math"
    tests: list[dict[str, Any]] = field(default_factory=list)
    """Code tests in `SandboxClient` form (stdin/expected_stdout, fn_name/args/expected, ...)."""
    messages: list[dict[str, str]] | None = None
    """The prompt as the data file gave it when that was chat messages (verl's `prompt`):
    a workflow that sends it unchanged keeps the data's own instructions."""
    data_source: str = ""
    """verl's `data_source` (passed to a verl-signature reward function)."""
    extra_info: dict[str, Any] = field(default_factory=dict)
    """verl's `extra_info`, or the row's other columns (passed to reward functions)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Problem:
        return cls(**d)
