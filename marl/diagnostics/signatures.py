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
- evaluator verdicts (Table 5, Panels A1-A2): `boxed_correct_rate` is the share of
  evaluator turns whose verdict (the last `\\boxed{}`, as Eval-Opt reads it) is
  `\\boxed{Correct}`, `unparseable_rate` the share with no parseable verdict
  (1 - `verdict_parse_rate`);
- orchestrator openers: distinct first three words (lower-cased, punctuation dropped) (Table 6's diversity proxy);
- length gap: p95 - p50 of a role's lengths (Table 6's synthesizer bimodality; also read
  on workers).

Eval-Opt's rounds apart (Table 5 reads the evaluator's and generator's iter-1 outputs):
besides `sig/<role>/<name>` over every turn, the same names over the first round only,
`sig/<role>/iter1/<name>` (generator slot 0, the first answer; evaluator slot 0, the
first evaluation), and over the later rounds, `sig/<role>/later/<name>` (slots >= 1:
revisions and re-evaluations), each only when the step has such turns.
"""

from __future__ import annotations

import re
import string
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from marl.rewards.math_scoring import last_boxed
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


def boxed_correct_rate(turns: Sequence[Turn]) -> float:
    """Share of the turns whose verdict is `\\boxed{Correct}`."""
    return _rate(turns, (verdict(t.text) is True for t in turns))


def unparseable_rate(turns: Sequence[Turn]) -> float:
    """Share of the turns with no parseable `\\boxed{Correct|Incorrect}` verdict."""
    return _rate(turns, (verdict(t.text) is None for t in turns))


def opener(text: str) -> str:
    """First three words, lower-cased, punctuation around them dropped."""
    return " ".join(w.strip(string.punctuation).lower() for w in _WORD.findall(text)[:3])


def distinct_openers(turns: Sequence[Turn]) -> int:
    return len({opener(t.text) for t in turns})


def length_gap(turns: Sequence[Turn]) -> float:
    s = lengths(turns)
    return s.p95 - s.p50


def _signatures(
    turns: Sequence[Turn], role: str, jaccard3: float | None = None
) -> dict[str, float]:
    """Every signature of one role's turns (at least one), by name."""
    n = lengths(turns)
    out = {
        "len_mean": n.mean,
        "len_p50": n.p50,
        "len_p95": n.p95,
        "len_gap": n.p95 - n.p50,
        "truncation_rate": truncation_rate(turns),
        "boxed_rate": boxed_rate(turns),
        "hedging_rate": hedging_rate(turns),
    }
    if jaccard3 is not None:
        out["jaccard3"] = jaccard3
    if role == "aggregator":
        out["terse_rate"] = terse_rate(turns)
    if role == "evaluator":
        out.update(evaluator_classes(turns))
        out["verdict_parse_rate"] = verdict_parse_rate(turns)
        out["boxed_correct_rate"] = boxed_correct_rate(turns)
        out["unparseable_rate"] = unparseable_rate(turns)
    if role == "orchestrator":
        out["distinct_openers"] = float(distinct_openers(turns))
    return out


ROUND_SPLIT = ("eval_opt",)
"""Workflows whose slot 0 is the first round and slots >= 1 the later ones (Eval-Opt)."""


def role_signatures(rollouts: Sequence[Rollout], workflow: str) -> dict[str, float]:
    """Every signature for every role in the rollouts, as `sig/<role>/<name>`, and for
    Eval-Opt also `sig/<role>/iter1/<name>` and `sig/<role>/later/<name>`; episodes that
    could not run are left out. `workflow` names the parallel roles."""
    good = [r for r in rollouts if r.error is None]
    by_role: dict[str, list[Turn]] = defaultdict(list)
    for r in good:
        for t in r.turns:
            by_role[t.role].append(t)
    out: dict[str, float] = {}
    for role, turns in sorted(by_role.items()):
        j = None
        if role in PARALLEL_ROLES.get(workflow, ()):
            j = inter_slot_jaccard(good, role)
        parts: list[tuple[str, list[Turn]]] = [("", turns)]
        if workflow in ROUND_SPLIT:
            parts.append(("iter1/", [t for t in turns if t.slot == 0]))
            parts.append(("later/", [t for t in turns if t.slot >= 1]))
        for part, chosen in parts:
            if chosen:
                for name, value in _signatures(chosen, role, j if not part else None).items():
                    out[f"sig/{role}/{part}{name}"] = value
    return out
