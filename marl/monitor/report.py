"""`marl report RUN_DIR`: one HTML page with the plots and transcripts the paper reads.

The paper's monitoring advice (§A.6.2) is per-role training metrics, per-role response
shape, and reading each role's transcripts at a few chosen checkpoints, because aggregate
accuracy hides role drift until the cliff. The report puts those side by side: reward and
validation accuracy; per-role χ² (the paper's `chi2_token` and marl's `update_chi2`),
training perplexity and gradient norm normalised to the first logged step (Fig. 6's shape); gradient-mass shares; per-role length and signature curves
recomputed from the saved rollouts; alarms as vertical lines on every time axis; one
transcript per role at the first, best and last step with saved rollouts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from marl.diagnostics.alarms import Alarm
from marl.diagnostics.rundir import RunData, load_run

TRANSCRIPT_CHARS = 4000
"""A transcript longer than this is cut in the page (the rollout file keeps all of it)."""

SIGNATURE_PANELS = (
    ("truncation_rate", "truncation rate"),
    ("boxed_rate", "\\boxed{} retention"),
    ("hedging_rate", "hedging-phrase rate"),
    ("jaccard3", "inter-slot 3-gram Jaccard"),
    ("terse_rate", "aggregator terse rate"),
    ("python_code_fence", "evaluator code-fence rate"),
    ("verdict_parse_rate", "evaluator verdict parse rate"),
    ("distinct_openers", "orchestrator distinct openers"),
    ("len_gap", "length gap p95 - p50 (tokens)"),
)


@dataclass
class Plot:
    file: str
    title: str
    caption: str


@dataclass
class Transcript:
    label: str
    step: int
    role: str
    slot: int
    tokens: int
    finish_reason: str
    reward: float
    text: str


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(int(r["step"]), float(r[key])) for r in records if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _roles(records: list[dict[str, Any]], prefix: str, suffix: str) -> list[str]:
    found = {
        k.split("/")[1] for r in records for k in r if k.startswith(prefix) and k.endswith(suffix)
    }
    return sorted(found)


def _mark_alarms(ax: Any, alarms: list[Alarm]) -> None:
    """A dashed line per alarm, its label one row lower than any label close to its left,
    so alarms a few steps apart stay readable."""
    low, high = ax.get_xlim()
    near = 0.15 * (high - low)
    placed: list[tuple[int, int]] = []
    for a in sorted(alarms, key=lambda a: a.step):
        taken = {row for step, row in placed if a.step - step < near}
        row = min(r for r in range(len(placed) + 1) if r not in taken)
        placed.append((a.step, row))
        ax.axvline(a.step, color="crimson", linestyle="--", linewidth=1, alpha=0.7)
        ax.annotate(
            f"{a.mechanism}\n[{a.role}]",
            (a.step, 1.0 - 0.09 * row),
            xycoords=("data", "axes fraction"),
            fontsize=6,
            color="crimson",
            va="top",
            ha="left",
        )



def _mark_splits(ax: Any, records: list[dict[str, Any]]) -> None:
    """A solid line where the guard split a role off its shared adapter (guard.py)."""
    for r in records:
        guard = str(r.get("guard", ""))
        if guard.startswith("split"):
            ax.axvline(int(r["step"]), color="darkgreen", linewidth=1.2, alpha=0.8)
            ax.annotate(
                f"split\n{r.get('routing', '')}",
                (int(r["step"]), 0.02),
                xycoords=("data", "axes fraction"),
                fontsize=6,
                color="darkgreen",
                va="bottom",
                ha="left",
            )


def _step_axes(ax: Any, run: RunData, legend: bool = True) -> None:
    """What every per-step plot shares: alarms and splits marked, a step axis, a legend, a
    grid."""
    _mark_alarms(ax, run.alarms)
    _mark_splits(ax, run.records)
    ax.set_xlabel("step")
    if legend:
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)

def _save(fig: Any, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return name


def plot_outcome(run: RunData, out: Path) -> Plot:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    for key, label, style in (
        ("train/reward_mean", "train reward (mean)", "-"),
        ("train/accuracy", "train accuracy", "-"),
        ("val/accuracy", "validation accuracy", "o-"),
        ("val/any_format_correct", "validation any-format accuracy", "s:"),
    ):
        x, y = _series(run.records, key)
        if x:
            ax.plot(x, y, style, label=label, markersize=4)
    _step_axes(ax, run)
    return Plot(
        _save(fig, out, "reward_accuracy.png"),
        "Reward and validation accuracy",
        "Training reward and accuracy every step; validation accuracy at each validation step.",
    )


def plot_normalised(run: RunData, out: Path) -> Plot | None:
    import matplotlib.pyplot as plt

    signals = [
        s
        for s in ("chi2_token", "update_chi2", "training_ppl", "grad_norm")
        if _roles(run.records, "role/", s)
    ]
    if not signals:
        return None
    fig, axes = plt.subplots(1, len(signals), figsize=(4 * len(signals), 3.4), squeeze=False)
    for ax, signal in zip(axes[0], signals, strict=True):
        for role in _roles(run.records, "role/", "/" + signal):
            x, y = _series(run.records, f"role/{role}/{signal}")
            first = next((v for v in y if v > 0), None)
            if first is not None:
                ax.plot(x, [v / first for v in y], "-", label=role)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_title(f"{signal} / first value", fontsize=9)
        _step_axes(ax, run)
    return Plot(
        _save(fig, out, "role_dynamics.png"),
        "Per-role training dynamics, normalised to the first step",
        "The paper's Fig. 6 shape: a role whose χ² or perplexity climbs while the others stay "
        "near 1 is the gradient_amplification fingerprint.",
    )


def plot_grad_share(run: RunData, out: Path) -> Plot | None:
    import matplotlib.pyplot as plt

    roles = _roles(run.records, "role/", "/grad_share")
    if not roles:
        return None
    fig, ax = plt.subplots(figsize=(8, 3.2))
    for role in roles:
        x, y = _series(run.records, f"role/{role}/grad_share")
        ax.plot(x, y, "-", label=role)
    ax.set_ylim(0, 1)
    ax.set_ylabel("share of gradient norm")
    _step_axes(ax, run)
    return Plot(
        _save(fig, out, "grad_share.png"),
        "Gradient-mass share per role",
        "Who drives the update; a rising dominant share is sp_role_capture evidence under "
        "a shared adapter.",
    )


def plot_lengths(run: RunData, out: Path) -> Plot | None:
    import matplotlib.pyplot as plt

    roles = _roles(run.records, "sig/", "/len_mean")
    if not roles:
        return None
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for i, role in enumerate(roles):
        color = f"C{i}"
        for stat, style in (("len_mean", "-"), ("len_p50", "--"), ("len_p95", ":")):
            x, y = _series(run.records, f"sig/{role}/{stat}")
            ax.plot(x, y, style, color=color, label=f"{role} {stat[4:]}")
    ax.set_ylabel("completion tokens")
    _step_axes(ax, run, legend=False)
    ax.legend(fontsize=7, ncol=2)
    return Plot(
        _save(fig, out, "role_lengths.png"),
        "Per-role completion length (mean, p50, p95)",
        "Recomputed from the saved rollouts; an aggregator or evaluator growing toward the "
        "generators' length is the sp_role_capture surface (Table 5).",
    )


def plot_signatures(run: RunData, out: Path) -> Plot | None:
    import matplotlib.pyplot as plt

    panels = [(k, t) for k, t in SIGNATURE_PANELS if _roles(run.records, "sig/", "/" + k)]
    if not panels:
        return None
    cols = 3
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 2.8 * rows), squeeze=False)
    for ax, (key, title) in zip(axes.flat, panels, strict=False):
        for role in _roles(run.records, "sig/", "/" + key):
            x, y = _series(run.records, f"sig/{role}/{key}")
            ax.plot(x, y, "o-", markersize=3, label=role)
        ax.set_title(title, fontsize=9)
        _step_axes(ax, run)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    return Plot(
        _save(fig, out, "role_signatures.png"),
        "Per-role trajectory signatures",
        "The paper's §A.3-A.4 columns, recomputed from the saved rollouts of each step.",
    )


def pick_steps(run: RunData) -> list[tuple[str, int]]:
    """First, best (nearest saved step to the best validation step) and last saved steps."""
    steps = sorted(s for s, rs in run.rollouts.items() if rs)
    if not steps:
        return []
    picked = [("first", steps[0])]
    val = [(int(r["step"]), float(r["val/accuracy"])) for r in run.records if "val/accuracy" in r]
    if val:
        best_step = max(val, key=lambda p: (p[1], -p[0]))[0]
        picked.append(("best", min(steps, key=lambda s: (abs(s - best_step), s))))
    picked.append(("last", steps[-1]))
    return picked


def transcripts(run: RunData) -> list[Transcript]:
    out = []
    for label, step in pick_steps(run):
        seen: set[str] = set()
        for r in run.rollouts[step]:
            if r.error is not None:
                continue
            for t in r.turns:
                if t.role in seen:
                    continue
                seen.add(t.role)
                text = (
                    t.text
                    if len(t.text) <= TRANSCRIPT_CHARS
                    else t.text[:TRANSCRIPT_CHARS] + " [...]"
                )
                out.append(
                    Transcript(
                        label,
                        step,
                        t.role,
                        t.slot,
                        len(t.completion_ids),
                        t.finish_reason,
                        r.reward,
                        text,
                    )
                )
    return out


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write report.html and its PNGs (into `out_dir`, default the run directory)."""
    import matplotlib

    matplotlib.use("Agg")
    from jinja2 import Environment, PackageLoader

    run = load_run(run_dir)
    out = Path(out_dir) if out_dir is not None else run.path
    out.mkdir(parents=True, exist_ok=True)
    plots = [
        p
        for p in (
            plot_outcome(run, out),
            plot_normalised(run, out),
            plot_grad_share(run, out),
            plot_lengths(run, out),
            plot_signatures(run, out),
        )
        if p is not None
    ]
    # transcripts are model output: escape everything (the .j2 suffix defeats select_autoescape)
    env = Environment(loader=PackageLoader("marl", "templates"), autoescape=True)
    last = run.records[-1] if run.records else {}
    html = env.get_template("report.html.j2").render(
        run=run,
        spec=run.spec,
        steps=int(last.get("step", 0)),
        plots=plots,
        alarms=run.alarms,
        logged_alarms=run.logged_alarms,
        transcripts=transcripts(run),
        final_val=next(
            (r["val/accuracy"] for r in reversed(run.records) if "val/accuracy" in r), None
        ),
    )
    page = out / "report.html"
    page.write_text(html)
    return page
