"""A reward function in verl's signature, used by marl unchanged (`reward.function`).

verl calls `compute_score(data_source, solution_str, ground_truth, extra_info)` for
its `custom_reward_function`; marl does the same, and logs every numeric entry of
the returned mapping besides `score` as a metric (`train/acc`, `val/acc`).
"""

from __future__ import annotations

from typing import Any

from marl.rewards.math_scoring import last_boxed


def compute_score(data_source: str, solution_str: str, ground_truth: str,
                  extra_info: dict[str, Any] | None = None) -> dict[str, Any]:
    boxed = last_boxed(solution_str)
    right = boxed is not None and boxed.strip() == str(ground_truth).strip()
    return {"score": 1.0 if right else 0.0, "acc": float(right),
            "formatted": float(boxed is not None), "pred": boxed or ""}
