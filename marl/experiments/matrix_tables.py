"""The numbers of `marl matrix report`: the paper's Tables 1-6 computed from the cells' metrics.

Pure functions over each cell's `metrics.jsonl` records (one JSON object per step, flat keys);
`marl/experiments/matrix_report.py` reads the files and writes what these return. A key a run did not log
gives an empty cell, never an error: older runs, user workflows and runs still going all read.

Definitions (the paper's unless marked marl's):
- Base: the cell's own untrained workflow, its step-0 validation (every adapter at version 0,
  whose LoRA B is zero: the base model in that workflow).
- Peak and its step: the best validation accuracy over steps >= 1 (step 0 is Base), the first
  step reaching it. Final: the last validation. Delta-peak and Delta-final: against Base.
- Cliff (marl's flag, not the paper's): final at least `alarms.cliff_drop` (the cell's own
  threshold, the `accuracy_cliff` alarm's) below peak.
- Table 2's ratios: a series' maximum over the run divided by its first logged value (blank
  when that is not positive); the χ² column's peak step is the step of that maximum. The χ²
  read is named in `chi2_metric`: by default (`auto`) the paper's `chi2_token` unless every
  value of it stayed within the cell's `alarms.chi2_noise_floor` (learner and sampler
  computing the same float32 logits), then marl's `update_chi2`; a ratio of rounding noise
  is never printed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from marl.experiments.matrix import Cell

BASE_CONTROL = "base"
SA_RL_CONTROL = "sa_rl"
CONTROL_WORKFLOW = "single"

CHI2_METRICS = ("chi2_token", "update_chi2")
"""Table 2's χ² series: the paper's token-level χ² (mean ρ² - 1, ρ = π_learner / π_sampler), or
marl's `update_chi2`, how far the policy moved during the step (the one that moves on a
float32 CPU run, where ρ is 1 to rounding)."""
CHI2_CHOICES = ("auto", *CHI2_METRICS)
"""What `marl matrix report --chi2` takes: `auto` reads each cell's `chi2_token` unless it
stayed within the cell's `alarms.chi2_noise_floor`, and its `update_chi2` then
(marl.diagnostics.alarms.chi2_series)."""
NOISE = "chi2_token: noise floor"
"""Table 2's `chi2_metric` where `chi2_token` was asked for and is rounding noise: no ratio."""
LEGACY = {"training_ppl": "perplexity", "update_chi2": "chi2"}
"""Per-role metric names logged before the learner's rename, read when a run has no new one."""
TOLERANCE = 1e-12
"""Slack on the cliff threshold, so 0.5 - 0.4 counts as a drop of 0.1."""


# ---------------------------------------------------------------- one cell's records


@dataclass
class CellRun:
    """A cell and its records, one per step (a step logged twice counts with its last)."""

    cell: Cell
    records: list[dict[str, Any]]

    @classmethod
    def of(cls, cell: Cell, rows: list[dict[str, Any]]) -> CellRun:
        by_step: dict[int, dict[str, Any]] = {}
        for r in rows:
            by_step[int(r["step"])] = r
        return cls(cell, [by_step[s] for s in sorted(by_step)])

    def series(self, key: str | None) -> list[tuple[int, float]]:
        if key is None:
            return []
        out = []
        for r in self.records:
            v = r.get(key)
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
                out.append((int(r["step"]), float(v)))
        return out

    def at(self, step: int) -> dict[str, Any]:
        return next((r for r in self.records if int(r["step"]) == step), {})

    def has(self, key: str) -> bool:
        return any(key in r for r in self.records)

    def chi2(self, asked: str) -> str:
        """The χ² series read for this cell: `asked`, or under `auto` `chi2_token` unless it
        stayed within the cell's `alarms.chi2_noise_floor` (then `update_chi2`)."""
        from marl.diagnostics.alarms import chi2_series

        return chi2_series(self.records, asked, self.cell.spec.alarms.chi2_noise_floor)

    @property
    def chi2_is_noise(self) -> bool:
        """Every `chi2_token` the cell logged is within its noise floor."""
        from marl.diagnostics.alarms import chi2_noise

        return chi2_noise(self.records, self.cell.spec.alarms.chi2_noise_floor)

    def key(self, prefix: str, metric: str) -> str | None:
        """`prefix + metric` if the run logged it, else its pre-rename name, else None."""
        for name in (metric, LEGACY.get(metric)):
            if name is not None and self.has(prefix + name):
                return prefix + name
        return None

    @property
    def routing(self) -> dict[str, str]:
        """Role -> adapter, from the cell's spec."""
        from marl.workflows.routing import policy_of_role

        return policy_of_role(self.cell.spec)

    @property
    def roles(self) -> list[str]:
        """The workflow's roles, then any other role the records name."""
        roles = list(self.routing)
        for r in self.records:
            for k in r:
                if k.startswith("role/"):
                    role = k.split("/")[1]
                    if role not in roles:
                        roles.append(role)
        return roles

    @property
    def shared_adapters(self) -> dict[str, list[str]]:
        """Adapters serving more than one role (under SP, the one adapter): adapter -> roles."""
        by: dict[str, list[str]] = {}
        for role, adapter in self.routing.items():
            by.setdefault(adapter, []).append(role)
        return {a: rs for a, rs in by.items() if len(rs) > 1}


def policy_kind(cell: Cell) -> str | None:
    """`ip` (an adapter per role type), `sp` (one for every role) or None (other groupings)."""
    spec = cell.spec
    if spec.policy_groups is not None:
        groups = set(spec.policy_groups.values())
        if len(groups) == 1:
            return "sp"
        return "ip" if len(groups) == len(spec.policy_groups) else None
    return "ip" if spec.policy == "isolated" else "sp"


def policy_label(cell: Cell) -> str:
    """Table 1's policy column: the policy axis value, or which control."""
    if cell.kind == SA_RL_CONTROL:
        return "sa_rl"
    if cell.kind == BASE_CONTROL:
        return "base_model"
    return cell.policy


def ident(cell: Cell) -> dict[str, Any]:
    return {
        "task": cell.task,
        "model": cell.model,
        "workflow": cell.workflow,
        "policy": policy_label(cell),
        "seed": cell.seed,
    }


# ---------------------------------------------------------------- Table 1


TABLE1 = (
    "task", "model", "workflow", "policy", "seed", "base", "peak", "peak_step", "final",
    "delta_peak", "delta_final", "cliff", "vs_sa_rl", "cliff_drop", "val_decoding", "alarms",
    "cell",
)  # fmt: skip


def val_decoding(cell: Cell) -> str:
    """How the cell's validation decodes: `sampled T=0.7` (the rollout temperature, or
    `sampling.val_temperature`, each turn seeded by problem and slot and never by step,
    so every checkpoint reads the same draws) or `greedy`."""
    t = cell.spec.sampling.validation_temperature
    return "greedy" if t == 0 else f"sampled T={t:g}"


def accuracy_summary(points: list[tuple[int, float]], cliff_drop: float) -> dict[str, Any]:
    """Base, peak (steps >= 1), its first step, final, the deltas and the cliff flag of one
    validation curve [(step, accuracy)]; what a curve lacks is None."""
    base = next((a for s, a in points if s == 0), None)
    later = [(s, a) for s, a in points if s >= 1]
    out: dict[str, Any] = {"base": base, "peak": None, "peak_step": None, "final": None,
                           "delta_peak": None, "delta_final": None, "cliff": None}  # fmt: skip
    if not later:
        return out
    peak = max(a for _, a in later)
    final = later[-1][1]
    out.update(
        peak=peak,
        peak_step=next(s for s, a in later if a == peak),
        final=final,
        cliff=int(peak - final >= cliff_drop - TOLERANCE),
    )
    if base is not None:
        out.update(delta_peak=peak - base, delta_final=final - base)
    return out


def alarm_list(records: list[dict[str, Any]]) -> list[str]:
    """`step N: alarm` for every alarm and guard action the run logged, first onset only."""
    alarms: list[str] = []
    for r in records:
        alarms += [f"step {r['step']}: {a}" for a in r.get("alarms") or []]
        if r.get("guard"):
            alarms.append(f"step {r['step']}: guard {r['guard']}")
    return list(dict.fromkeys(alarms))


def table1(runs: list[CellRun]) -> list[dict[str, Any]]:
    """One row per cell, the controls included: the SA-RL row is its (task, model, seed)
    block's single-agent RL run, and `vs_sa_rl` is a cell's peak minus that run's peak (the
    paper's residual); the base-model control's row has only its Base."""
    sa_peak: dict[tuple[str, str, int], float] = {}
    rows = []
    for run in runs:
        c = run.cell
        drop = c.spec.alarms.cliff_drop
        row = {**ident(c), **accuracy_summary(run.series("val/accuracy"), drop)}
        row.update(cliff_drop=drop, alarms=alarm_list(run.records), cell=c.name,
                   val_decoding=val_decoding(c))
        if c.kind == SA_RL_CONTROL and row["peak"] is not None:
            sa_peak[(c.task, c.model, c.seed)] = row["peak"]
        rows.append(row)
    for run, row in zip(runs, rows, strict=True):
        c = run.cell
        sa = sa_peak.get((c.task, c.model, c.seed))
        if c.kind == "run" and sa is not None and row["peak"] is not None:
            row["vs_sa_rl"] = row["peak"] - sa
    return [{k: row.get(k) for k in TABLE1} for row in rows]


# ---------------------------------------------------------------- Table 1, the paper's layout


@dataclass(frozen=True)
class Curve:
    """The validation-accuracy curve of one run and what the paper's Table 1 reads off it."""

    steps: list[int]
    accuracy: list[float]
    alarms: list[str]

    @property
    def base(self) -> float | None:
        """Step 0: the untrained workflow."""
        return self.accuracy[0] if self.steps[0] == 0 else None

    @property
    def _trained(self) -> list[tuple[int, float]]:
        pts = list(zip(self.steps, self.accuracy, strict=True))
        return [p for p in pts if p[0] >= 1] or pts

    @property
    def peak(self) -> float:
        """The best accuracy after step 0 (step 0 only when the curve has nothing later)."""
        return max(a for _, a in self._trained)

    @property
    def peak_step(self) -> int:
        """The first step at which the peak was reached."""
        return next(s for s, a in self._trained if a == self.peak)

    @property
    def final(self) -> float:
        return self.accuracy[-1]

    @property
    def cliff(self) -> float:
        """Final minus peak: 0 when the run ended at its best, negative after a cliff."""
        return self.final - self.peak


def curve(rows: list[dict[str, Any]]) -> Curve | None:
    """The curve of a run's metrics rows (None when it never validated). A step logged
    twice (a run resumed after a rollback) counts with its last value."""
    by_step: dict[int, float] = {}
    for r in rows:
        if r.get("val/accuracy") is not None:
            by_step[int(r["step"])] = float(r["val/accuracy"])
    if not by_step:
        return None
    steps = sorted(by_step)
    return Curve(steps, [by_step[s] for s in steps], alarm_list(rows))


COLUMNS = (
    "task", "model", "seed", "workflow", "base", "sa_rl", "ip_peak", "sp_peak",
    "ip_residual", "sp_residual", "ip_final", "sp_final", "ip_cliff", "sp_cliff",
    "ip_peak_step", "sp_peak_step", "val_decoding", "ip_alarms", "sp_alarms",
)  # fmt: skip
HEADERS = {
    "base": "Base", "sa_rl": "SA-RL", "ip_peak": "IP peak", "sp_peak": "SP peak",
    "ip_residual": "IP − SA-RL", "sp_residual": "SP − SA-RL", "ip_final": "IP final",
    "sp_final": "SP final", "ip_cliff": "IP cliff", "sp_cliff": "SP cliff",
    "ip_peak_step": "IP peak step", "sp_peak_step": "SP peak step",
    "val_decoding": "validation", "ip_alarms": "IP alarms", "sp_alarms": "SP alarms",
}  # fmt: skip


def table_rows(curves: dict[Cell, Curve | None]) -> list[dict[str, Any]]:
    """The paper's Table 1 layout: one row per (task, model, seed, workflow) with its Base
    (the workflow's own step 0), the SA-RL control's peak, IP and SP peak accuracy, their
    residuals against SA-RL (peak - SA-RL peak), final accuracy, cliff depth (final - peak),
    step of the peak and alarms. Missing cells leave blanks."""
    rows: dict[tuple[str, str, int, str], dict[str, Any]] = {}
    controls: dict[tuple[str, str, int], dict[str, float]] = {}
    for cell, c in curves.items():
        if cell.kind != "run" and c is not None:
            # the base control is its single evaluation; SA-RL is read at its peak
            controls.setdefault((cell.task, cell.model, cell.seed), {})[cell.kind] = (
                c.final if cell.kind == BASE_CONTROL else c.peak
            )
    for cell, c in curves.items():
        if cell.kind != "run":
            continue
        key = (cell.task, cell.model, cell.seed, cell.workflow)
        ctl = controls.get(key[:3], {})
        row = rows.setdefault(key, {
            "task": cell.task, "model": cell.model, "seed": cell.seed,
            "workflow": cell.workflow, "base": None, "sa_rl": ctl.get(SA_RL_CONTROL),
        })  # fmt: skip
        if c is not None and row["base"] is None:
            row["base"] = c.base
        decoding = val_decoding(cell)
        if decoding not in (row.get("val_decoding") or "").split(" / "):
            row["val_decoding"] = " / ".join(filter(None, [row.get("val_decoding"), decoding]))
        p = policy_kind(cell)
        if p is None or c is None:
            continue
        row[f"{p}_peak"] = c.peak
        row[f"{p}_final"] = c.final
        row[f"{p}_cliff"] = c.cliff
        row[f"{p}_peak_step"] = c.peak_step
        row[f"{p}_alarms"] = c.alarms
        if row["sa_rl"] is not None:
            row[f"{p}_residual"] = c.peak - row["sa_rl"]
    for (task, model, seed, _), row in rows.items():
        if row["base"] is None:
            row["base"] = controls.get((task, model, seed), {}).get(BASE_CONTROL)
    return [{k: row.get(k) for k in COLUMNS} for row in rows.values()]


# ---------------------------------------------------------------- Table 2


TABLE2 = (
    "task", "model", "workflow", "policy", "seed", "role", "chi2_peak_over_first",
    "ppl_peak_over_first", "grad_norm_peak_over_first", "chi2_peak_step", "chi2_metric",
)  # fmt: skip


def peak_over_first(points: list[tuple[int, float]]) -> tuple[float | None, int | None]:
    """max / first of a series (None unless first > 0) and the first step of the max."""
    if not points:
        return None, None
    first = points[0][1]
    peak = max(v for _, v in points)
    step = next(s for s, v in points if v == peak)
    return (peak / first if first > 0 else None), step


def table2(runs: list[CellRun], chi2: str = "auto") -> list[dict[str, Any]]:
    """One row per role of every trained cell (`role/<role>/...`), and under a shared adapter
    one more row named after it from its own series (`policy/<adapter>/...`): the paper's
    single shared-policy row. `chi2_metric` names the χ² series read (`CellRun.chi2`); a
    `chi2_token` asked for by name that is rounding noise gives no ratio (`NOISE`)."""
    assert chi2 in CHI2_CHOICES, chi2
    rows = []
    for run in runs:
        if run.cell.kind == BASE_CONTROL:
            continue
        metric = run.chi2(chi2)
        noise = metric == "chi2_token" and run.chi2_is_noise
        prefixes = [(role, f"role/{role}/") for role in run.roles]
        roles = set(run.roles)
        for adapter in run.shared_adapters:
            label = adapter if adapter not in roles else f"policy:{adapter}"
            prefixes.append((label, f"policy/{adapter}/"))
        for label, prefix in prefixes:
            chi2_ratio, chi2_step = (None, None) if noise else peak_over_first(
                run.series(run.key(prefix, metric)))
            ppl, _ = peak_over_first(run.series(run.key(prefix, "training_ppl")))
            grad, _ = peak_over_first(run.series(run.key(prefix, "grad_norm")))
            rows.append({
                **ident(run.cell), "role": label, "chi2_peak_over_first": chi2_ratio,
                "ppl_peak_over_first": ppl, "grad_norm_peak_over_first": grad,
                "chi2_peak_step": chi2_step, "chi2_metric": NOISE if noise else metric,
            })  # fmt: skip
    return rows


# ---------------------------------------------------------------- Table 3


TABLE3 = (
    "task", "model", "seed", "workflow", "role", "sa_rl_checkpoint", "sa_rl_final", "sa_rl_peak",
    "transfer", "workflow_base", "transfer_minus_base", "transfer_minus_sa_rl",
    "val_problems", "episode_errors", "note",
)  # fmt: skip


def table3(
    expected: list[tuple[str, str, int, str]],
    results: dict[tuple[str, str, int, str], dict[str, Any]],
    t1: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """Paper Table 3, the SA-RL adapter on each workflow's generator role and the base model
    on the others: one row per expected (task, model, seed, workflow); `results` are the
    evaluations `marl matrix` saved. SA-RL final is the accuracy of the checkpoint deployed,
    workflow base the workflow's own step-0 accuracy (its IP cell's, else any)."""
    sa = {(r["task"], r["model"], r["seed"]): r for r in t1 if r["policy"] == "sa_rl"}
    base: dict[tuple[str, str, int, str], float] = {}
    for r in sorted(t1, key=lambda r: r["policy"] != "isolated"):
        k = (r["task"], r["model"], r["seed"], r["workflow"])
        if r["policy"] not in ("sa_rl", "base_model") and r["base"] is not None:
            base.setdefault(k, r["base"])
    rows = []
    for key in expected:
        task, model, seed, workflow = key
        s = sa.get((task, model, seed), {})
        row: dict[str, Any] = {"task": task, "model": model, "seed": seed,
                               "workflow": workflow, "sa_rl_peak": s.get("peak"),
                               "workflow_base": base.get(key)}  # fmt: skip
        res = results.get(key)
        if res is None:
            row["note"] = "not evaluated yet: `marl matrix` runs it once the SA-RL cell is done"
        elif res.get("note"):
            row["note"] = res["note"]
        else:
            acc = float(res["val/accuracy"])
            row.update(
                role=res.get("role"),
                sa_rl_checkpoint=res.get("checkpoint"),
                sa_rl_final=res.get("sa_rl_final"),
                transfer=acc,
                val_problems=res.get("val/problems"),
                episode_errors=res.get("val/episode_errors"),
            )
            if row["workflow_base"] is not None:
                row["transfer_minus_base"] = acc - row["workflow_base"]
            if row["sa_rl_final"] is not None:
                row["transfer_minus_sa_rl"] = acc - row["sa_rl_final"]
        rows.append({k: row.get(k) for k in TABLE3})
    return rows


# ---------------------------------------------------------------- Tables 4-6


@dataclass(frozen=True)
class SignatureTable:
    number: int
    workflow: str
    title: str
    columns: tuple[tuple[str, str], ...]
    """(column, `val/sig/` key suffix)."""


def _cols(role: str, *names: str, sub: str = "") -> tuple[tuple[str, str], ...]:
    col = f"{role}_{sub.rstrip('/')}_" if sub else f"{role}_"
    return tuple((col + n, f"{role}/{sub}{n}") for n in names)


SIGNATURE_TABLES = (
    SignatureTable(
        4, "voting",
        "Voting (paper Table 4 Panel C1, Table 5 Panel A3): generator length, truncation, "
        "\\boxed{} retention, hedging and inter-generator 3-gram Jaccard; aggregator length "
        "and terse rate",
        _cols("generator", "len_mean", "len_p50", "len_p95", "truncation_rate", "boxed_rate",
              "hedging_rate", "jaccard3")
        + _cols("aggregator", "len_p50", "len_p95", "terse_rate"),
    ),
    SignatureTable(
        5, "eval_opt",
        "Eval-Opt (paper Table 5 Panels A1-A2): the evaluator's output classes and verdict "
        "rates, iteration 1 apart from later rounds; evaluator and generator lengths, "
        "truncation and \\boxed{} retention",
        _cols("evaluator", "python_code_fence", "bare_stamp", "other", "boxed_correct_rate",
              "unparseable_rate", sub="iter1/")
        + _cols("evaluator", "python_code_fence", "bare_stamp", "other", "boxed_correct_rate",
                "unparseable_rate", sub="later/")
        + _cols("evaluator", "boxed_correct_rate", "unparseable_rate", "verdict_parse_rate",
                "len_p50", "len_p95", "truncation_rate")
        + _cols("generator", "truncation_rate", "boxed_rate", sub="iter1/")
        + _cols("generator", "len_p50", "len_p95", "truncation_rate", "boxed_rate"),
    ),
    SignatureTable(
        6, "orch_workers",
        "Orch-Workers (paper Table 6, Table 4 Panel C2): worker length, truncation, "
        "\\boxed{} retention, hedging and inter-worker 3-gram Jaccard; orchestrator distinct "
        "3-word openers; synthesizer p50/p95 and their gap",
        _cols("worker", "len_mean", "len_p50", "len_p95", "len_gap", "truncation_rate",
              "boxed_rate", "hedging_rate", "jaccard3")
        + _cols("orchestrator", "distinct_openers", "len_p50")
        + _cols("synthesizer", "len_p50", "len_p95", "len_gap"),
    ),
)  # fmt: skip

SIGNATURE_LEAD = ("checkpoint", "step", "val_accuracy", "val_problems")


def checkpoints(points: list[tuple[int, float]]) -> list[tuple[str, int]]:
    """The first, peak (steps >= 1) and final validation steps of a curve."""
    if not points:
        return []
    out = [("first", points[0][0])]
    later = [(s, a) for s, a in points if s >= 1]
    if later:
        peak = max(a for _, a in later)
        out.append(("peak", next(s for s, a in later if a == peak)))
        out.append(("final", later[-1][0]))
    return out


def signature_columns(table: SignatureTable) -> tuple[str, ...]:
    head = ("task", "model", "workflow", "policy", "seed")
    return head + SIGNATURE_LEAD + tuple(c for c, _ in table.columns)


def signature_rows(runs: list[CellRun], table: SignatureTable) -> list[dict[str, Any]]:
    """Each trained cell of the table's workflow at its first, peak and final validation
    checkpoints: the `val/sig/...` signatures logged there (blank where not logged)."""
    rows = []
    for run in runs:
        if run.cell.kind != "run" or run.cell.spec.workflow != table.workflow:
            continue
        for label, step in checkpoints(run.series("val/accuracy")):
            r = run.at(step)
            row = {
                **ident(run.cell),
                "checkpoint": label,
                "step": step,
                "val_accuracy": r.get("val/accuracy"),
                "val_problems": r.get("val/problems"),
            }
            for col, suffix in table.columns:
                row[col] = r.get(f"val/sig/{suffix}")
            rows.append(row)
    return rows


# ---------------------------------------------------------------- Fig. 5's statistics


def global_grad_norm(run: CellRun) -> list[tuple[int, float]]:
    """`train/grad_norm` where logged, else each step's norm over every adapter's gradient
    (the root of the sum of the squared `policy/<adapter>/grad_norm`)."""
    if run.has("train/grad_norm"):
        return run.series("train/grad_norm")
    adapters = sorted(set(run.routing.values()))
    out = []
    for r in run.records:
        vals = [r.get(f"policy/{a}/grad_norm") for a in adapters]
        nums = [float(v) for v in vals if isinstance(v, int | float)]
        if nums:
            out.append((int(r["step"]), math.sqrt(sum(v * v for v in nums))))
    return out


def instability(run: CellRun, chi2: str = "auto") -> dict[str, float | None]:
    """Fig. 5's three statistics of one cell over its whole run: the largest χ² of any adapter
    (of any role where the run has no per-adapter series; the series `CellRun.chi2` reads,
    none where that is `chi2_token` at its noise floor), the largest adapter gradient norm
    (per role where none per adapter), and the entropy collapse depth, first minus minimum
    (of `train/entropy` where logged, else the deepest of any role's)."""
    adapters = sorted(set(run.routing.values()))
    chi2 = run.chi2(chi2)
    noise = chi2 == "chi2_token" and run.chi2_is_noise

    def peak(prefixes: list[str], metric: str) -> float | None:
        vals = [v for p in prefixes for _, v in run.series(run.key(p, metric))]
        return max(vals) if vals else None

    by_adapter = [f"policy/{a}/" for a in adapters]
    by_role = [f"role/{r}/" for r in run.roles]
    max_chi2 = None if noise else peak(by_adapter, chi2)
    if max_chi2 is None and not noise:
        max_chi2 = peak(by_role, chi2)
    max_grad = peak(by_adapter, "grad_norm")
    if max_grad is None:
        max_grad = peak(by_role, "grad_norm")
    entropies = (
        [run.series("train/entropy")]
        if run.has("train/entropy")
        else [run.series(run.key(p, "entropy")) for p in by_role]
    )
    depths = [s[0][1] - min(v for _, v in s) for s in entropies if s]
    return {
        "max_chi2": max_chi2,
        "max_grad_norm": max_grad,
        "entropy_collapse": max(depths) if depths else None,
    }
