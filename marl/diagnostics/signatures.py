"""Trajectory-level signatures of role drift (paper §A.3-A.4, Tables 4-6), from transcripts.

Pure functions over `marl.rollout.Rollout` / `Turn`: the learner can compute them on the
rollouts of a step and `marl report` can recompute them from a run's saved
`rollouts/step_N.jsonl`, and both get the same numbers. The paper reads these on 100
problems per checkpoint because token-level training metrics miss `sp_role_capture`
(§4.4): an aggregator slot that turns verbose, or an evaluator that starts writing code,
shows only in what the role says.

Definitions, taken from the paper:
- length: completion tokens (`len(turn.completion_ids)`); p50/p95 are nearest-rank
  (`sorted[min(n - 1, int(q * n))]`, the learner's `role/<role>/response_len_p*`);
- truncation: the turn stopped at the response cap (`finish_reason == "length"`);
- boxed retention: the turn contains a parseable `\\boxed{}` (the math reward's parser);
- hedging: the turn contains a phrase of §A.4's fixed list (whole words, any case);
- inter-slot Jaccard: 3-gram Jaccard of completion tokens between every pair of a
  parallel role's slots in one episode, averaged within the episode, then over a
  problem's episodes, then over problems (token ids, not words: a tokenizer that
  decodes without spaces still yields 3-grams);
- aggregator terse: at most 30 tokens with a parseable `\\boxed{}` (Table 5, Panel A3);
- evaluator output class (Table 5, Panel A1): `python_code_fence` (a python fenced block
  of >= 3 non-blank body lines), `bare_stamp` (<= 200 tokens, a parseable
  `\\boxed{Correct|Incorrect}`, no fenced block), else `other`; verdict parse rate is the
  share with a parseable verdict;
- orchestrator openers: distinct first three words (lower-cased, punctuation dropped) (Table 6's diversity proxy);
- length gap: p95 - p50 of a role's lengths (Table 6's synthesizer bimodality; also read
  on workers).
"""

from __future__ import annotations

import re
import string
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from marl.rewards.math import last_boxed
from marl.rollout import Rollout, Turn

HEDGING_PHRASES = (
    "wait",
    "alternatively",
    "actually",
    "hmm",
    "let me reconsider",
    "on second thought",
    "not correct",
    "this is wrong",
)
"""§A.4's fixed list."""

_HEDGE = re.compile(
    r"\b(?:" + "|".join(re.escape(p).replace(r"\ ", r"\s+") for p in HEDGING_PHRASES) + r")\b",
    re.IGNORECASE,
)
_FENCE = re.compile(r"```[ \t]*(\w*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_WORD = re.compile(r"\S+")

TERSE_MAX_TOKENS = 30
STAMP_MAX_TOKENS = 200
FENCE_MIN_LINES = 3

PARALLEL_ROLES = {"voting": ("generator",), "orch_workers": ("worker",)}
"""Roles whose slots run side by side on the same prompt (the same-role parallelism of §5.1)."""


def parallel_roles(workflow: str) -> tuple[str, ...] | None:
    """The workflow's parallel roles; None for a user workflow (its shape is unknown here)."""
    if ":" in workflow:
        return None
    return PARALLEL_ROLES.get(workflow, ())


EVAL_CLASSES = ("python_code_fence", "bare_stamp", "other")


@dataclass(frozen=True)
class LengthStats:
    mean: float
    p50: float
    p95: float


def _rank(values: Sequence[int], q: float) -> float:
    s = sorted(values)
    return float(s[min(len(s) - 1, int(q * len(s)))])


def lengths(turns: Sequence[Turn]) -> LengthStats:
    """Completion-token length mean, p50 and p95 of the turns (at least one)."""
    n = [len(t.completion_ids) for t in turns]
    return LengthStats(sum(n) / len(n), _rank(n, 0.5), _rank(n, 0.95))


def _rate(turns: Sequence[Turn], hit: Iterable[bool]) -> float:
    return sum(hit) / len(turns)


def truncation_rate(turns: Sequence[Turn]) -> float:
    return _rate(turns, (t.finish_reason == "length" for t in turns))


def boxed_rate(turns: Sequence[Turn]) -> float:
    return _rate(turns, (last_boxed(t.text) is not None for t in turns))


def hedges(text: str) -> bool:
    return _HEDGE.search(text) is not None


def hedging_rate(turns: Sequence[Turn]) -> float:
    return _rate(turns, (hedges(t.text) for t in turns))


def trigrams(ids: Sequence[int]) -> set[tuple[int, ...]]:
    return {tuple(ids[i : i + 3]) for i in range(len(ids) - 2)}


def jaccard(a: set[tuple[int, ...]], b: set[tuple[int, ...]]) -> float:
    """|a & b| / |a | b|; two texts without a single 3-gram count as identical (1.0)."""
    union = a | b
    return len(a & b) / len(union) if union else 1.0


def episode_jaccard(turns: Sequence[Turn]) -> float | None:
    """Mean pairwise 3-gram Jaccard over the turns' slots (one turn per slot: the first);
    None with fewer than two slots."""
    first: dict[int, Turn] = {}
    for t in turns:
        first.setdefault(t.slot, t)
    grams = [trigrams(first[s].completion_ids) for s in sorted(first)]
    pairs = [
        jaccard(grams[i], grams[j]) for i in range(len(grams)) for j in range(i + 1, len(grams))
    ]
    return sum(pairs) / len(pairs) if pairs else None


def inter_slot_jaccard(rollouts: Sequence[Rollout], role: str) -> float | None:
    """Within an episode, then over a problem's episodes, then over problems."""
    by_problem: dict[str, list[float]] = defaultdict(list)
    for r in rollouts:
        j = episode_jaccard([t for t in r.turns if t.role == role])
        if j is not None:
            by_problem[r.problem_id].append(j)
    per_problem = [sum(v) / len(v) for v in by_problem.values()]
    return sum(per_problem) / len(per_problem) if per_problem else None


def is_terse(turn: Turn) -> bool:
    return len(turn.completion_ids) <= TERSE_MAX_TOKENS and last_boxed(turn.text) is not None


def terse_rate(turns: Sequence[Turn]) -> float:
    return _rate(turns, (is_terse(t) for t in turns))


def verdict(text: str) -> bool | None:
    """True for `\\boxed{Correct}`, False for `\\boxed{Incorrect}`, None when neither (the
    Eval-Opt workflow's own reading)."""
    boxed = last_boxed(text)
    word = None if boxed is None else boxed.strip().strip(".").lower()
    return {"correct": True, "incorrect": False}.get(word or "")


def evaluator_class(turn: Turn) -> str:
    fences = _FENCE.findall(turn.text)
    for lang, body in fences:
        if lang.lower() in ("python", "py", "python3"):
            if sum(bool(line.strip()) for line in body.splitlines()) >= FENCE_MIN_LINES:
                return "python_code_fence"
    if (
        not fences
        and len(turn.completion_ids) <= STAMP_MAX_TOKENS
        and verdict(turn.text) is not None
    ):
        return "bare_stamp"
    return "other"


def evaluator_classes(turns: Sequence[Turn]) -> dict[str, float]:
    got = [evaluator_class(t) for t in turns]
    return {c: got.count(c) / len(got) for c in EVAL_CLASSES}


def verdict_parse_rate(turns: Sequence[Turn]) -> float:
    return _rate(turns, (verdict(t.text) is not None for t in turns))


def opener(text: str) -> str:
    """First three words, lower-cased, punctuation around them dropped."""
    return " ".join(w.strip(string.punctuation).lower() for w in _WORD.findall(text)[:3])


def distinct_openers(turns: Sequence[Turn]) -> int:
    return len({opener(t.text) for t in turns})


def length_gap(turns: Sequence[Turn]) -> float:
    s = lengths(turns)
    return s.p95 - s.p50


def role_signatures(rollouts: Sequence[Rollout], workflow: str) -> dict[str, float]:
    """Every signature for every role in the rollouts, as `sig/<role>/<name>`; episodes
    that could not run are left out. `workflow` names the parallel roles."""
    good = [r for r in rollouts if r.error is None]
    by_role: dict[str, list[Turn]] = defaultdict(list)
    for r in good:
        for t in r.turns:
            by_role[t.role].append(t)
    out: dict[str, float] = {}
    for role, turns in sorted(by_role.items()):
        pre = f"sig/{role}/"
        n = lengths(turns)
        out[pre + "len_mean"] = n.mean
        out[pre + "len_p50"] = n.p50
        out[pre + "len_p95"] = n.p95
        out[pre + "len_gap"] = n.p95 - n.p50
        out[pre + "truncation_rate"] = truncation_rate(turns)
        out[pre + "boxed_rate"] = boxed_rate(turns)
        out[pre + "hedging_rate"] = hedging_rate(turns)
        if role in PARALLEL_ROLES.get(workflow, ()):
            j = inter_slot_jaccard(good, role)
            if j is not None:
                out[pre + "jaccard3"] = j
        if role == "aggregator":
            out[pre + "terse_rate"] = terse_rate(turns)
        if role == "evaluator":
            for c, v in evaluator_classes(turns).items():
                out[pre + c] = v
            out[pre + "verdict_parse_rate"] = verdict_parse_rate(turns)
        if role == "orchestrator":
            out[pre + "distinct_openers"] = float(distinct_openers(turns))
    return out
