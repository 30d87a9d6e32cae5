"""An LLM judge as a reward: the judge reads the problem, the reference and the answer,
and its verdict, the last `\\boxed{N}` (or the last number) over `judge.max_score`, is the
reward, clipped to [0, 1].

    reward:
      judge: {model: base, max_score: 10}      # reward.function defaults to this

Who judges is `reward.judge` (marl.config.JudgeSpec): the run's frozen base model on its
own inference replicas (`model: base`), a loaded adapter there (`run/policy@version`), or
any OpenAI-compatible endpoint (`endpoint`, e.g. another marl replica's `/v1`). The
judge's turn is recorded in the rollout (`judge_turns`) and not trained; when
`policy_groups` names the judge role, its adapter serves it and it trains as any role
(services/workflow/judge_client.py). A verdict with no number scores 0 and is counted as
`judge_parsed` 0; a judge that does not answer fails the rollout.
"""

from __future__ import annotations

import re
from typing import Any

from marl.problem import Problem
from marl.rewards.math_scoring import last_boxed

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def verdict_score(text: str, max_score: float) -> float | None:
    """The verdict's score over `max_score`, clipped to [0, 1]; None when there is none."""
    boxed = last_boxed(text)
    found = _NUMBER.findall(boxed if boxed is not None else text)
    if not found:
        return None
    return min(1.0, max(0.0, float(found[-1]) / max_score))


def judge_prompt(template: str, problem: Problem, answer: str) -> str:
    """The judge's message: `{problem}`, `{reference}` and `{answer}` filled in (other
    braces are left as they are)."""
    return (template.replace("{problem}", problem.prompt)
            .replace("{reference}", problem.answer or "(none)")
            .replace("{answer}", answer))


async def judge_reward(problem: Problem, answer: str, episode: Any) -> dict[str, float]:
    cfg = episode.task.judge
    verdict = await episode.judge(
        [{"role": "user", "content": judge_prompt(cfg["prompt"], problem, answer)}])
    score = verdict_score(verdict, float(cfg["max_score"]))
    return {"score": 0.0 if score is None else score, "judge_parsed": float(score is not None)}
