"""Bounded staleness: which rollouts are too old to train on (`train.max_staleness`).

Every turn records the adapter version that served it. A step trains with each adapter
at its current version; a turn served `lag` versions earlier was sampled by a policy
`lag` updates old. A rollout with any turn more than K versions behind is dropped
whole (its episode's later turns read the old turn's text), marked as an episode error
so its group's advantages are computed without it.
"""

from __future__ import annotations

import dataclasses

from marl.rollout import Rollout


def turn_lags(rollout: Rollout, current: dict[str, int]) -> list[int]:
    """How many versions behind `current` (adapter name -> version) each turn's adapter is."""
    return [
        current[t.adapter.name] - t.adapter.version
        for t in rollout.turns
        if t.adapter.name in current
    ]


def drop_stale(
    rollouts: list[Rollout], current: dict[str, int], max_staleness: int
) -> tuple[list[Rollout], dict[str, float]]:
    """The rollouts, each one with a turn more than `max_staleness` versions behind
    turned into an error, and the step's staleness metrics."""
    out: list[Rollout] = []
    lags: list[int] = []
    dropped = 0
    for r in rollouts:
        if r.error is not None:
            out.append(r)
            continue
        lag = turn_lags(r, current)
        lags += lag
        worst = max(lag, default=0)
        if worst > max_staleness:
            dropped += 1
            r = dataclasses.replace(
                r,
                error=f"stale: a turn {worst} versions behind (train.max_staleness="
                f"{max_staleness})",
            )
        out.append(r)
    metrics = {
        "train/stale_dropped": float(dropped),
        "train/staleness_mean": sum(lags) / len(lags) if lags else 0.0,
        "train/staleness_max": float(max(lags, default=0)),
    }
    return out, metrics
