"""Role drift alarms over a run's metric records: fire before the accuracy cliff (paper §4-5).

Pure functions over the records `metrics.jsonl` holds
(`{"step": n, "role/<role>/chi2_token": ...}`), with thresholds from the RunSpec's `alarms`
section (marl's choices; the paper names the mechanisms, not numbers). The paper's point
is that aggregate accuracy hides role drift until a late cliff, so each alarm reads one
role's own series. "χ²" below is the series `alarms.chi2_signal` names: the paper's
`chi2_token`, or marl's `update_chi2`; by default (`auto`, `chi2_series`) `chi2_token`
unless every value of it so far is within `alarms.chi2_noise_floor`, where it is rounding
noise and `update_chi2` is read instead.

- `gradient_amplification` (§5.1, Fig. 6a, Table 2): Isolated-Policy only, and only a role
  with parallel slots (Voting's generators, Orch-Workers' workers): its χ² or training
  perplexity, normalised to its first values, reaches `amplification_ratio` and
  `amplification_margin` times every other role's ratio of the same signal. Under a
  shared adapter the same per-role shape is not this mechanism and does not fire it;
- `sp_role_capture` (§5.2; shared adapters only), both of the paper's manifestations:
  token-distribution asymmetry (Tables 5): a role's output shape moves toward another
  role's: its median length grows `capture_length_ratio`-fold while closing the gap to a
  longer role, the aggregator loses its terseness, or the evaluator starts writing code
  fences; and per-episode frequency asymmetry (Table 6, Fig. 6b): a multi-slot role holds
  most of the episode's slots (at least `capture_dominant_share` of the gradient) while the
  shared adapter's global χ² or training perplexity escalates `capture_amplitude_ratio`-fold
  over its first values; the alarm names the multi-slot role;
- `entropy_collapse` (§4.2, Fig. 5): a role's token entropy falls below
  `(1 - entropy_drop)` times its first values;
- `accuracy_cliff`: validation accuracy falls `cliff_drop` below its best so far;
- `sampler_mismatch` (not the paper's; names an adapter, not a role): the mean gap between
  the log-probs inference reported when sampling and the learner's recompute of the same
  tokens, `policy/<adapter>/logprob_gap`, reaches `logprob_gap_max`. The learner then
  trains on tokens another policy sampled, as when an adapter push silently failed and
  inference still serves an old version. A single step fires it: the gap is a mean over
  every token the adapter served that step, not a noisy series.

Training-side signals (χ², perplexity, entropy) are logged every step and are noisy
step to step, so they compare the mean of their last `window` values with the mean of
their first `window`; χ² below `amplification_chi2_floor` counts as the floor, since a
ratio of two near-zero χ² values is noise.
Validation signatures (lengths, rates over 50-100 problems) compare first and last.
A role's gradient-mass share alone is plotted, not alarmed on: as one role's groups
saturate (every rollout right, zero advantage) the other roles' shares rise in a healthy
run.

An alarm is reported at its onset: the step its condition turns true after being false
(or never evaluated), so a run that stays drifted is not re-alarmed every step.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from marl.spec.run import AlarmSpec

Record = dict[str, Any]

EPS = 1e-9
"""Slack on differences of rates, so 0.60 - 0.55 meets a 0.05 threshold despite float rounding."""


@dataclass(frozen=True)
class Alarm:
    mechanism: str
    """gradient_amplification | sp_role_capture | entropy_collapse | accuracy_cliff |
    sampler_mismatch."""
    role: str
    """The drifting role; `all` for validation accuracy; the adapter for sampler_mismatch."""
    step: int
    evidence: str
    """The numbers that crossed the threshold, in words."""

    def __str__(self) -> str:
        return f"{self.mechanism}[{self.role}]@{self.step}: {self.evidence}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def series(records: Sequence[Record], key: str) -> list[tuple[int, float]]:
    """(step, value) of every record that logs `key`."""
    return [(int(r["step"]), float(r[key])) for r in records if r.get(key) is not None]


def roles(records: Sequence[Record]) -> list[str]:
    found = {k.split("/")[1] for r in records for k in r if k.startswith(("role/", "sig/"))}
    return sorted(found)


def _current(records: Sequence[Record], key: str) -> list[tuple[int, float]] | None:
    """The key's series if the last record logs it (the check applies at this step)."""
    if not records or records[-1].get(key) is None:
        return None
    return series(records, key)


def _windows(s: list[tuple[int, float]], window: int) -> tuple[float, float]:
    """Mean of the first `window` values (the baseline) and of the last `window` (now)."""
    first = [v for _, v in s[:window]]
    last = [v for _, v in s[-window:]]
    return sum(first) / len(first), sum(last) / len(last)


def _training_series(
    records: Sequence[Record], key: str, spec: AlarmSpec
) -> list[tuple[int, float]] | None:
    """A per-step training signal, once it has two whole windows of values."""
    s = _current(records, key)
    if s is None or len(s) < max(spec.min_points, 2 * spec.window):
        return None
    return s


CHI2_TOKEN, UPDATE_CHI2 = "chi2_token", "update_chi2"


def chi2_noise(records: Sequence[Record], floor: float) -> bool:
    """Whether every per-role and per-adapter `chi2_token` the records hold is within
    ±`floor` (none logged counts as noise: there is no signal to read)."""
    return all(
        abs(v) <= floor
        for r in records
        for k, v in r.items()
        if k.endswith("/" + CHI2_TOKEN) and k.startswith(("role/", "policy/"))
        and isinstance(v, int | float) and not isinstance(v, bool)
    )


def chi2_series(records: Sequence[Record], signal: str, floor: float) -> str:
    """The χ² series to read: `signal` itself unless it is `auto`, which is `chi2_token`
    once it leaves its noise floor and `update_chi2` while it has not."""
    if signal != "auto":
        return signal
    return UPDATE_CHI2 if chi2_noise(records, floor) else CHI2_TOKEN


def _floors(spec: AlarmSpec, records: Sequence[Record]) -> dict[str, float]:
    """The training-side signals the amplitude checks read, with the floor of each ratio."""
    signal = chi2_series(records, spec.chi2_signal, spec.chi2_noise_floor)
    return {signal: spec.amplification_chi2_floor, "training_ppl": 1.0}


def _ratio(records: Sequence[Record], key: str, floor: float, spec: AlarmSpec) -> float | None:
    """Mean of the last window over the mean of the first, both at least `floor`."""
    s = _training_series(records, key, spec)
    if s is None:
        return None
    first, now = _windows(s, spec.window)
    return max(now, floor) / max(first, floor)


def _amplification(
    records: Sequence[Record], spec: AlarmSpec, parallel: Collection[str] | None
) -> Iterator[tuple[str, Alarm | None]]:
    step = int(records[-1]["step"])
    for signal, floor in _floors(spec, records).items():
        ratios: dict[str, float] = {}
        for role in roles(records):
            ratio = _ratio(records, f"role/{role}/{signal}", floor, spec)
            if ratio is not None:
                ratios[role] = ratio
        if len(ratios) < 2:
            continue
        for role, ratio in ratios.items():
            if parallel is not None and role not in parallel:
                continue
            others = max(v for r, v in ratios.items() if r != role)
            fire = ratio >= spec.amplification_ratio and ratio >= spec.amplification_margin * others
            yield (
                f"gradient_amplification/{role}/{signal}",
                Alarm(
                    "gradient_amplification",
                    role,
                    step,
                    f"{signal} {ratio:.2f}x its first value vs at most {others:.2f}x "
                    "for the other roles",
                )
                if fire
                else None,
            )


def _frequency_capture(
    records: Sequence[Record], spec: AlarmSpec, parallel: Collection[str]
) -> Iterator[tuple[str, Alarm | None]]:
    """Per-episode frequency asymmetry: a multi-slot role drives a shared adapter whose
    global amplitude escalates (Orch-Workers-SP's 3 workers of 5 slots, Fig. 6b)."""
    last = records[-1]
    step = int(last["step"])
    adapters = sorted({k.split("/")[1] for k in last if k.startswith("policy/")})
    for role in parallel:
        share = last.get(f"role/{role}/grad_share")
        if share is None:
            continue
        for adapter in adapters:
            for signal, floor in _floors(spec, records).items():
                ratio = _ratio(records, f"policy/{adapter}/{signal}", floor, spec)
                if ratio is None:
                    continue
                fire = (
                    ratio >= spec.capture_amplitude_ratio and share >= spec.capture_dominant_share
                )
                evidence = (
                    f"shared adapter {adapter}'s {signal} {ratio:.2f}x its first value while "
                    f"{role} carries {share:.2f} of its gradient"
                )
                yield (
                    f"sp_role_capture/{role}/{adapter}/{signal}",
                    Alarm("sp_role_capture", role, step, evidence) if fire else None,
                )


def _length_capture(
    records: Sequence[Record], spec: AlarmSpec
) -> Iterator[tuple[str, Alarm | None]]:
    step = int(records[-1]["step"])
    lengths: dict[str, list[tuple[int, float]]] = {}
    for role in roles(records):
        for key in (f"sig/{role}/len_p50", f"role/{role}/response_len_p50"):
            s = _current(records, key)
            if s is not None and len(s) >= spec.min_points and s[0][1] > 0:
                lengths[role] = s
                break
    for role, s in lengths.items():
        first, now = s[0][1], s[-1][1]
        fired = None
        for other, o in lengths.items():
            o_first, o_now = o[0][1], o[-1][1]
            if (
                other != role
                and o_first > first
                and now >= spec.capture_length_ratio * first
                and abs(o_now - now) < o_first - first
            ):
                fired = Alarm(
                    "sp_role_capture",
                    role,
                    step,
                    f"median length {first:.0f} -> {now:.0f} tokens "
                    f"({now / first:.2f}x), toward {other}'s {o_now:.0f}",
                )
                break
        yield f"sp_role_capture/{role}/length", fired


def _shift(
    records: Sequence[Record],
    spec: AlarmSpec,
    key: str,
    sign: float,
    threshold: float,
    what: str,
    relative: bool = False,
) -> Iterator[tuple[str, Alarm | None]]:
    """A rate moving `threshold` away from its first value in the direction `sign`;
    `relative`: `threshold` is a fraction of the first value."""
    for role in roles(records):
        s = _current(records, f"sig/{role}/{key}")
        if s is None or len(s) < spec.min_points:
            continue
        first, now = s[0][1], s[-1][1]
        fire = sign * (now - first) >= (threshold * first if relative else threshold) - EPS
        evidence = f"{what} {first:.2f} -> {now:.2f}"
        yield (
            f"sp_role_capture/{role}/{key}",
            Alarm("sp_role_capture", role, int(records[-1]["step"]), evidence) if fire else None,
        )


def _entropy(records: Sequence[Record], spec: AlarmSpec) -> Iterator[tuple[str, Alarm | None]]:
    for role in roles(records):
        s = _training_series(records, f"role/{role}/entropy", spec)
        if s is None:
            continue
        first, now = _windows(s, spec.window)
        if first <= 0:
            continue
        fire = now <= (1 - spec.entropy_drop) * first
        evidence = f"token entropy {first:.3f} -> {now:.3f} ({now / first:.2f}x its first value)"
        yield (
            f"entropy_collapse/{role}",
            Alarm("entropy_collapse", role, int(records[-1]["step"]), evidence) if fire else None,
        )


def _cliff(records: Sequence[Record], spec: AlarmSpec) -> Iterator[tuple[str, Alarm | None]]:
    s = _current(records, "val/accuracy")
    if s is None or len(s) < 2:
        return
    best_step, best = max(s[:-1], key=lambda p: (p[1], -p[0]))
    step, now = s[-1]
    fire = best - now >= spec.cliff_drop - EPS
    evidence = (
        f"validation accuracy {now:.3f}, down {best - now:.3f} from {best:.3f} at step {best_step}"
    )
    yield "accuracy_cliff", Alarm("accuracy_cliff", "all", step, evidence) if fire else None


def _sampler_mismatch(
    records: Sequence[Record], spec: AlarmSpec
) -> Iterator[tuple[str, Alarm | None]]:
    last = records[-1]
    step = int(last["step"])
    for key, gap in sorted(last.items()):
        if not (key.startswith("policy/") and key.endswith("/logprob_gap")) or gap is None:
            continue
        adapter = key.split("/")[1]
        kl = last.get(f"policy/{adapter}/logprob_kl")
        evidence = f"sampling and learner log-probs differ by {gap:.3f} per token" + (
            "" if kl is None else f" (KL estimate {kl:.4f})"
        )
        fire = gap >= spec.logprob_gap_max
        yield (
            f"sampler_mismatch/{adapter}",
            Alarm("sampler_mismatch", adapter, step, evidence) if fire else None,
        )


def check(
    records: Sequence[Record],
    spec: AlarmSpec,
    shared: bool,
    parallel: Collection[str] | None = None,
) -> dict[str, Alarm | None]:
    """Every condition that applies at the last record: its key -> the alarm, or None when
    it holds quiet. `shared`: one adapter serves several roles, the only routing in which
    one role can capture another's slot (sp_role_capture) and in which
    gradient_amplification, an Isolated-Policy mechanism, is not checked. `parallel`: the
    roles whose slots run side by side, the only ones gradient_amplification can name
    (§5.1: same-role parallelism amplifies; a lone role's noisy χ² is not that mechanism)
    and the multi-slot roles of frequency asymmetry; None (a user workflow) lets every role
    be named by the first and checks the second for none."""
    if not records:
        return {}
    out: dict[str, Alarm | None] = {}
    checks = [
        _entropy(records, spec),
        _cliff(records, spec),
        _sampler_mismatch(records, spec),
    ]
    if not shared:
        checks.append(_amplification(records, spec, parallel))
    else:
        checks += [
            _frequency_capture(records, spec, parallel or ()),
            _length_capture(records, spec),
            _shift(
                records, spec, "terse_rate", -1.0, spec.capture_terse_drop, "terse rate",
                relative=True,
            ),
            _shift(
                records, spec, "python_code_fence", 1.0, spec.capture_fence_rise, "code-fence rate"
            ),
        ]
    for found in checks:
        out.update(found)
    return out


class AlarmWatch:
    """Follows a run record by record and reports each alarm at its onset."""

    def __init__(self, spec: AlarmSpec, shared: bool, parallel: Collection[str] | None = None):
        self.spec = spec
        self.shared = shared
        self.parallel = parallel
        self.records: list[Record] = []
        self.firing: dict[str, bool] = {}

    def update(self, record: Record) -> list[Alarm]:
        self.records.append(record)
        new: list[Alarm] = []
        for key, alarm in check(self.records, self.spec, self.shared, self.parallel).items():
            if alarm is not None and not self.firing.get(key, False):
                new.append(alarm)
            self.firing[key] = alarm is not None
        return new


def scan(
    records: Sequence[Record],
    spec: AlarmSpec,
    shared: bool,
    parallel: Collection[str] | None = None,
) -> list[Alarm]:
    """Every alarm onset over a whole run, in step order."""
    watch = AlarmWatch(spec, shared, parallel)
    return [a for r in records for a in watch.update(r)]
