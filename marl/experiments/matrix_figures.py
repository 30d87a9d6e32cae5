"""The figures of `marl matrix report` (paper Figs. 2-6), as PNGs drawn with matplotlib (Agg).

Each takes the rows or cell runs of marl/experiments/matrix_tables.py and a path; a figure with nothing
to show yet still writes a PNG that says so, so the report's page never has a hole.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from marl.experiments.matrix_tables import CellRun, global_grad_norm, instability, policy_kind

COLORS = {"ip": "tab:blue", "sp": "tab:orange", "sa_rl": "0.55", None: "tab:green"}
LABELS = {"ip": "IP", "sp": "SP", "sa_rl": "SA-RL", None: "other"}
MARKERS = {"single": "s", "voting": "o", "eval_opt": "^", "orch_workers": "D"}
CODES = {"single": "S", "voting": "V", "eval_opt": "E", "orch_workers": "O"}
"""Workflow codes on crowded axes (the paper's E, V, O)."""
DPI = 100


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    _plt().close(fig)


def _empty(path: Path, title: str, why: str) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 2.5))
    ax.set_axis_off()
    ax.set_title(title)
    ax.text(0.5, 0.5, why, ha="center", va="center", wrap=True)
    _save(fig, path)


def _block(run: CellRun) -> tuple[str, str, int]:
    return (run.cell.task, run.cell.model, run.cell.seed)


def _block_label(block: tuple[str, str, int], many_seeds: bool) -> str:
    task, model, seed = block
    return f"{task} / {model}" + (f" / s{seed}" if many_seeds else "")


def _blocks(runs: list[CellRun]) -> tuple[list[tuple[str, str, int]], bool]:
    blocks = list(dict.fromkeys(_block(r) for r in runs))
    return blocks, len({b[2] for b in blocks}) > 1


def _normalised(points: list[tuple[int, float]]) -> tuple[list[int], list[float]] | None:
    """A series over its first value (None when that is not positive)."""
    if not points or points[0][1] <= 0:
        return None
    first = points[0][1]
    return [s for s, _ in points], [v / first for _, v in points]


# ---------------------------------------------------------------- Fig. 2


def fig2(t1: list[dict[str, Any]], kinds: dict[str, str | None], path: Path) -> None:
    """Per-cell Δ of peak validation accuracy against the cell's own base (bars), Δ final
    (black ticks), grouped by (task, model, seed) block and workflow, coloured by policy.
    `kinds` maps a cell name to ip / sp / sa_rl / None."""
    rows = [r for r in t1 if r["policy"] != "base_model" and r["delta_peak"] is not None]
    if not rows:
        _empty(path, "Fig. 2: Δ validation accuracy vs. base", "no trained cell has validated")
        return
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.32 * len(rows) + 2.5), 4.2))
    x = 0.0
    ticks: list[tuple[float, str]] = []
    last_block: Any = None
    last_group: Any = None
    seen: set[str | None] = set()
    for r in rows:
        block = (r["task"], r["model"], r["seed"])
        group = (block, r["workflow"], r["policy"] == "sa_rl")
        if group != last_group:
            x += 1.6 if block != last_block else 0.6
            ticks.append((x, "SA-RL" if r["policy"] == "sa_rl" else r["workflow"]))
            if block != last_block:
                ax.text(x - 0.4, 1.02, f"{r['task']} / {r['model']} / s{r['seed']}",
                        transform=ax.get_xaxis_transform(), fontsize=8, color="0.3")  # fmt: skip
        kind = kinds.get(r["cell"])
        ax.bar(x, r["delta_peak"], width=0.8, color=COLORS[kind],
               label=LABELS[kind] if kind not in seen else None)  # fmt: skip
        seen.add(kind)
        if r["delta_final"] is not None:
            ax.plot([x - 0.4, x + 0.4], [r["delta_final"]] * 2, color="k", lw=1.5)
        last_block, last_group = block, group
        x += 1.0
    ax.axhline(0, color="0.4", lw=0.8)
    ax.set_xticks([t for t, _ in ticks], [s for _, s in ticks], rotation=30, ha="right",
                  fontsize=8)  # fmt: skip
    ax.plot([], [], color="k", lw=1.5, label="Δ final")
    ax.set_ylabel("peak − base (validation accuracy)")
    ax.set_title("Fig. 2: per-cell Δ against the cell's own base", pad=18)
    ax.legend(fontsize=8, loc="best")
    _save(fig, path)


# ---------------------------------------------------------------- Fig. 3


def plot_scatter(rows: list[dict[str, Any]], path: Path) -> None:
    """Fig. 3: IP vs. SP peak accuracy per matched cell (the paper's Table 1 layout rows),
    with the diagonal (IP = SP); marker shape = workflow, colour = task, size = model (in
    the matrix's order, smallest first)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.6, 5.2))
    pts = [r for r in rows if r["ip_peak"] is not None and r["sp_peak"] is not None]
    vals = [v for r in pts for v in (r["ip_peak"], r["sp_peak"])] or [0.0, 1.0]
    lo, hi = max(0.0, min(vals) - 0.05), min(1.0, max(vals) + 0.05)
    ax.plot([lo, hi], [lo, hi], color="0.6", lw=1, ls="--", label="IP = SP")
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    models = list(dict.fromkeys(r["model"] for r in rows))
    for r in pts:
        color = f"C{tasks.index(r['task']) % 10}"
        size = 30 + 40 * models.index(r["model"])
        ax.scatter(
            r["sp_peak"],
            r["ip_peak"],
            s=size,
            c=color,
            clip_on=False,
            marker=MARKERS.get(r["workflow"], "o"),
            edgecolors="k",
            linewidths=0.5,
        )
        ax.annotate(f"{CODES.get(r['workflow'], r['workflow'])} {r['model']}",
                    (r["sp_peak"], r["ip_peak"]), textcoords="offset points", xytext=(4, 4),
                    fontsize=7)  # fmt: skip
    for i, task in enumerate(tasks):
        ax.scatter([], [], c=f"C{i % 10}", marker="o", label=f"task {task}")
    for wf in dict.fromkeys(r["workflow"] for r in pts):
        ax.scatter([], [], c="w", edgecolors="k", marker=MARKERS.get(wf, "o"), label=wf)
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("SP peak validation accuracy")
    ax.set_ylabel("IP peak validation accuracy")
    ax.set_title("Fig. 3: IP vs. SP per cell (above the diagonal: IP better)")
    ax.legend(loc="lower right", fontsize=7)
    _save(fig, path)


# ---------------------------------------------------------------- Fig. 4


def _success_key(run: CellRun) -> str:
    return "train/accuracy" if run.has("train/accuracy") else "train/reward_mean"


def fig4(runs: list[CellRun], path: Path) -> None:
    """IP vs. SP per workflow: training success rate (`train/accuracy`, else the mean
    reward; top row of each block) and validation accuracy (bottom row)."""
    trained = [r for r in runs if r.cell.kind == "run"]
    if not trained:
        _empty(path, "Fig. 4: IP vs. SP training dynamics", "no trained cell yet")
        return
    blocks, many = _blocks(trained)
    workflows = list(dict.fromkeys(r.cell.workflow for r in trained))
    plt = _plt()
    nrows, ncols = 2 * len(blocks), len(workflows)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.3 * ncols, 2.3 * nrows), squeeze=False)
    for b, block in enumerate(blocks):
        for w, wf in enumerate(workflows):
            top, bottom = axes[2 * b][w], axes[2 * b + 1][w]
            for run in trained:
                if _block(run) != block or run.cell.workflow != wf:
                    continue
                kind = policy_kind(run.cell)
                label = f"{LABELS[kind]} ({run.cell.policy})"
                for ax, key in ((top, _success_key(run)), (bottom, "val/accuracy")):
                    pts = run.series(key)
                    if pts:
                        ax.plot([s for s, _ in pts], [v for _, v in pts], marker=".",
                                color=COLORS[kind], label=label)  # fmt: skip
            top.set_title(f"{wf}\n{_block_label(block, many)}", fontsize=9)
            top.set_ylabel("training success", fontsize=8)
            bottom.set_ylabel("validation accuracy", fontsize=8)
            bottom.set_xlabel("step", fontsize=8)
            if top.lines:
                top.legend(fontsize=7)
    fig.suptitle("Fig. 4: IP vs. SP training success (top) and validation accuracy (bottom)")
    _save(fig, path)


# ---------------------------------------------------------------- Fig. 5


def fig5(runs: list[CellRun], chi2: str, path: Path) -> None:
    """Per matched cell and policy: max χ², max adapter gradient norm, entropy collapse
    depth (first - minimum) over the whole run (matrix_tables.instability)."""
    trained = [r for r in runs if r.cell.kind == "run" and policy_kind(r.cell) is not None]
    stats = [(r, instability(r, chi2)) for r in trained]
    if not stats:
        _empty(path, "Fig. 5: training-side instability amplitude", "no trained cell yet")
        return
    blocks, many = _blocks(trained)
    groups = list(dict.fromkeys((_block(r), r.cell.workflow) for r in trained))
    plt = _plt()
    read = " / ".join(sorted({r.chi2(chi2) for r in trained}))
    panels = (("max_chi2", f"max χ² ({read})"), ("max_grad_norm", "max adapter grad norm"),
              ("entropy_collapse", "entropy collapse depth"))  # fmt: skip
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(max(6.0, 0.7 * len(groups) + 2), 7.5), squeeze=False
    )
    offsets = {"ip": -0.2, "sp": 0.2}
    for (key, title), ax in zip(panels, axes[:, 0], strict=True):
        seen: set[str] = set()
        for run, st in stats:
            kind = policy_kind(run.cell)
            assert kind is not None
            v = st[key]
            if v is None:
                continue
            x = groups.index((_block(run), run.cell.workflow)) + offsets[kind]
            ax.bar(x, v, width=0.4, color=COLORS[kind],
                   label=LABELS[kind] if kind not in seen else None)  # fmt: skip
            seen.add(kind)
        ax.set_ylabel(title, fontsize=8)
        labels = [f"{CODES.get(wf, wf)} {_block_label(b, many)}" for b, wf in groups]
        ax.set_xticks(range(len(groups)), labels, rotation=30, ha="right", fontsize=7)
        if seen:
            ax.legend(fontsize=7)
    axes[0, 0].set_title("Fig. 5: training-side instability amplitude, IP vs. SP")
    _save(fig, path)


# ---------------------------------------------------------------- Fig. 6


def _multi(run: CellRun) -> bool:
    return len(run.routing) > 1


def _pick(
    runs: list[CellRun], block: Any, kind: str, order: tuple[str, ...],
    ok: Callable[[CellRun], bool] = _multi,
) -> CellRun | None:  # fmt: skip
    mine = [
        r for r in runs
        if r.cell.kind == "run" and _block(r) == block and policy_kind(r.cell) == kind and ok(r)
    ]  # fmt: skip
    rank = {wf: i for i, wf in enumerate(order)}
    mine.sort(key=lambda r: rank.get(r.cell.spec.workflow, len(order)))
    return mine[0] if mine else None


def _of(runs: list[CellRun], block: Any, kind: str, workflow: str) -> CellRun | None:
    return next(
        (
            r
            for r in runs
            if r.cell.kind == "run"
            and _block(r) == block
            and policy_kind(r.cell) == kind
            and r.cell.spec.workflow == workflow
        ),
        None,
    )


def _panel_roles(ax: Any, run: CellRun, chi2: str, with_global: bool) -> None:
    chi2 = run.chi2(chi2)
    for i, role in enumerate(run.roles):
        color = f"C{i % 10}"
        for metric, style in ((chi2, "-"), ("training_ppl", "--")):
            if with_global and metric != chi2:
                continue
            norm = _normalised(run.series(run.key(f"role/{role}/", metric)))
            if norm is not None:
                ax.plot(*norm, ls=style, color=color, lw=1.2,
                        label=f"{role} {'χ²' if metric == chi2 else 'ppl'}")  # fmt: skip
    if with_global:
        adapters = sorted(set(run.routing.values()))
        series = [(f"{a} χ²", run.series(run.key(f"policy/{a}/", chi2))) for a in adapters]
        series += [(f"{a} ppl", run.series(run.key(f"policy/{a}/", "training_ppl")))
                   for a in adapters]  # fmt: skip
        series.append(("global grad norm", global_grad_norm(run)))
        for j, (label, pts) in enumerate(series):
            norm = _normalised(pts)
            if norm is not None:
                ax.plot(*norm, color="k", lw=2.0, ls=("-", "--", ":")[j % 3], label=label)
    ax.axhline(1.0, color="0.6", lw=0.8)
    ax.set_xlabel("step", fontsize=8)
    ax.set_ylabel("value / first value", fontsize=8)
    if ax.lines[1:]:
        ax.legend(fontsize=6)


def fig6(runs: list[CellRun], chi2: str, path: Path) -> None:
    """Per (task, model, seed) block: (a) an IP cell's per-role χ² (solid) and training
    perplexity (dashed) over their first values, Voting first (its generators are the
    parallel role); (b) an SP cell's per-role χ² and its shared adapter's global χ²,
    perplexity and gradient norm over their first values, Orch-Workers first; (c) IP vs. SP
    validation accuracy of one workflow, Orch-Workers first."""
    trained = [r for r in runs if r.cell.kind == "run"]
    if not trained:
        _empty(path, "Fig. 6: training dynamics on matched IP / SP cells", "no trained cell yet")
        return
    blocks, many = _blocks(trained)
    plt = _plt()
    fig, axes = plt.subplots(len(blocks), 3, figsize=(14, 3.4 * len(blocks)), squeeze=False)
    for b, block in enumerate(blocks):
        where = _block_label(block, many)
        a, bb, c = axes[b]
        ip = _pick(trained, block, "ip", ("voting", "orch_workers", "eval_opt"), _multi)
        sp = _pick(trained, block, "sp", ("orch_workers", "voting", "eval_opt"), _multi)
        for ax, run, tag, glob in ((a, ip, "(a) IP", False), (bb, sp, "(b) SP", True)):
            if run is None:
                ax.set_axis_off()
                ax.set_title(f"{tag}: no multi-role cell ({where})", fontsize=9)
                continue
            _panel_roles(ax, run, chi2, glob)
            ax.set_title(f"{tag} {run.cell.workflow} ({where}; χ² = {run.chi2(chi2)})",
                         fontsize=9)
        pairs = [
            wf
            for wf in ("orch_workers", "voting", "eval_opt", "single")
            if all(_of(trained, block, kind, wf) is not None for kind in ("ip", "sp"))
        ]
        if not pairs:
            c.set_axis_off()
            c.set_title(f"(c) no workflow with both IP and SP ({where})", fontsize=9)
            continue
        for kind in ("ip", "sp"):
            run = _of(trained, block, kind, pairs[0])
            assert run is not None
            pts = run.series("val/accuracy")
            c.plot([s for s, _ in pts], [v for _, v in pts], marker="o", color=COLORS[kind],
                   label=LABELS[kind])  # fmt: skip
        c.set_title(f"(c) {pairs[0]} IP vs. SP validation ({where})", fontsize=9)
        c.set_xlabel("step", fontsize=8)
        c.set_ylabel("validation accuracy", fontsize=8)
        c.legend(fontsize=7)
    fig.suptitle(f"Fig. 6: training dynamics on matched IP / SP cells (χ² = {chi2})")
    _save(fig, path)
