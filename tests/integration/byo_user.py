"""A user's own code for the bring-your-own tests: reward functions and workflows that
marl imports by name (`reward.function`, `workflow`), as a user's module would be."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from marl.problem import Problem
from marl.workflows import Episode, Workflow, prompts
from marl.workflows.tools import CALCULATOR, tool


def compute_score(data_source: str, solution_str: str, ground_truth: str,
                  extra_info: dict[str, Any] | None = None) -> dict[str, Any]:
    """verl's custom reward signature, unchanged: the last number against the truth."""
    numbers = re.findall(r"-?\d+", solution_str)
    right = bool(numbers) and numbers[-1] == str(ground_truth).strip()
    return {"score": 1.0 if right else 0.0, "acc": float(right),
            "has_number": float(bool(numbers)), "pred": numbers[-1] if numbers else "",
            "index_seen": float(isinstance(extra_info, dict) and "index" in extra_info)}


def boom(problem: Problem, answer: str, episode: Any) -> float:
    raise ValueError("the reward exploded")


async def not_a_number(problem: Problem, answer: str, episode: Any) -> float:
    await asyncio.sleep(0)
    return float("nan")


def roles_apart(problem: Problem, answer: str, episode: Any) -> dict[str, Any]:
    """The drafter is rewarded for writing digits, the checker for the right answer."""
    drafts = [t.text for t in episode.turns if t.role == "drafter"]
    right = float(problem.answer in answer)
    return {"score": right, "role_rewards": {
        "drafter": float(any(any(c.isdigit() for c in d) for d in drafts)),
        "checker": right}}


class CapsArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rounds: int = Field(1, ge=1, le=3)
    """Answers the solver writes; the last is final."""
    note: str = ""


async def _rounds(episode: Episode, problem: Problem) -> str:
    said = ""
    for _ in range(episode.args.rounds):
        said = await episode.turn("solver", 0, prompts.generator(problem))
    episode.facts["rounds_seen"] = float(episode.args.rounds)
    return said


ROUNDS = Workflow(name="rounds", roles=("solver",), run=_rounds, args=CapsArgs)


@tool
def explode(reason: str) -> str:
    """A tool that always raises."""
    raise RuntimeError(reason)


@tool(timeout_s=0.2)
async def sleepy(seconds: float) -> str:
    """A tool that sleeps."""
    await asyncio.sleep(seconds)
    return "awake"


async def _tools(episode: Episode, problem: Problem) -> str:
    return await episode.tool_turn("solver", 0, prompts.generator(problem),
                                   [CALCULATOR, explode, sleepy], max_tool_calls=6)


TOOLS = Workflow(name="tools", roles=("solver",), run=_tools)
"""One solver with a calculator, a tool that raises and one that times out."""
