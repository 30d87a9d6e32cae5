"""DAPO-Math-17K rows (BytedTsinghua-SIA/DAPO-Math-17k) as math problems.

Published schema (verl's RL format), one row per problem:
  data_source   string                       "math_dapo"
  prompt        list<struct<content, role>>  one user message
  ability       string                       "MATH"
  reward_model  struct<ground_truth, style>  the answer; style "rule-lighteval/MATH_v2"
  extra_info    struct<index>                a UUID string

The user message wraps the problem in an instruction to end with a line
"Answer: $Answer"; marl's roles are told to answer in `\\boxed{}` instead, so that
wrapper is removed and the prompt is the problem alone. The published file
repeats each problem many times; the repeats share `extra_info.index` and are
dropped as duplicates.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from marl.data.rows import RowError
from marl.problem import Problem

COLUMNS = ("prompt", "reward_model", "extra_info", "data_source")
INSTRUCTION_HEAD = (
    "Solve the following math problem step by step. The last line of your response should be "
    "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
INSTRUCTION_TAIL = '\n\nRemember to put your answer on its own line after "Answer:".'


def _user_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise RowError("`prompt` must be a list of {role, content} messages")
    users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    if not users or not isinstance(users[-1].get("content"), str):
        raise RowError("`prompt` has no user message with text content")
    return str(users[-1]["content"])


def problem_text(prompt: Any) -> str:
    """The problem statement inside DAPO's "Answer:" instruction wrapper."""
    text = _user_text(prompt)
    text = text.removeprefix(INSTRUCTION_HEAD).removesuffix(INSTRUCTION_TAIL).strip()
    if not text:
        raise RowError("`prompt` user message is empty")
    return text


def to_problem(row: dict[str, Any]) -> Problem:
    text = problem_text(row.get("prompt"))
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict):
        raise RowError("`reward_model` is missing (it holds `ground_truth`)")
    truth = reward_model.get("ground_truth")
    if isinstance(truth, int | float) and not isinstance(truth, bool):
        truth = str(truth)
    if not isinstance(truth, str) or not truth.strip():
        raise RowError("`reward_model.ground_truth` is missing or empty")
    extra = row.get("extra_info")
    index = extra.get("index") if isinstance(extra, dict) else None
    if index is None or str(index) == "":
        index = hashlib.sha1(text.encode()).hexdigest()[:16]
    source = row.get("data_source")
    return Problem(id=f"dapo-{index}", prompt=text, answer=truth.strip(), task="math",
                   data_source=source if isinstance(source, str) else "",
                   extra_info=json.loads(json.dumps(extra, default=str))
                   if isinstance(extra, dict) else {})
