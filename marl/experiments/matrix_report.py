"""`marl matrix report DIR`: the paper's analysis of a matrix directory, in `DIR/report/`.

Tables 1-6 each as CSV (full precision, blank where a value is missing) and Markdown, Figs.
2-6 as PNG, and `index.html` showing them all. Everything is read from disk: each done cell's
`metrics.jsonl` and the Table 3 evaluations `marl matrix` saved under `DIR/transfer/`;
the numbers are marl/experiments/matrix_tables.py's, the figures marl/experiments/matrix_figures.py's.
"""

from __future__ import annotations

import csv
import html
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marl.experiments import matrix_figures as figures
from marl.experiments import matrix_tables as tables
from marl.experiments.matrix import (
    Matrix,
    cell_dir,
    cell_done,
    load_curves,
    read_metrics,
    saved_matrix,
    transfer_done,
    transfer_path,
)
from marl.experiments.matrix_tables import CellRun
from marl.spec.run import SpecError

SIGNED = ("delta_peak", "delta_final", "vs_sa_rl", "transfer_minus_base", "transfer_minus_sa_rl")


def _csv_value(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, list):
        return " | ".join(str(x) for x in v)
    if isinstance(v, float):
        return repr(v)
    return str(v)


def write_csv(path: Path, rows: list[dict[str, Any]], columns: tuple[str, ...]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for row in rows:
            writer.writerow([_csv_value(row.get(k)) for k in columns])


def _md_value(key: str, v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, list):
        return f"{len(v)}: " + "; ".join(v[:3]) + (" …" if len(v) > 3 else "") if v else "0"
    if isinstance(v, float):
        sign = "+" if key in SIGNED and v > 0 else ""
        return f"{sign}{v:.0f}" if abs(v) >= 1000 else f"{sign}{v:.3f}"
    return str(v).replace("|", "\\|")


def md_table(rows: list[dict[str, Any]], columns: tuple[str, ...]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_md_value(k, row.get(k)) for k in columns) + " |")
    return "\n".join(lines)


# the paper's Table 1 layout, as `marl matrix report` has always printed it


def _fmt(key: str, v: Any) -> str:
    if v is None:
        return "–"
    if key.endswith("alarms"):
        return f"{len(v)}: " + "; ".join(v[:3]) + (" …" if len(v) > 3 else "") if v else "0"
    if isinstance(v, float):
        sign = "+" if key.endswith(("residual", "cliff")) and v > 0 else ""
        return f"{sign}{v:.3f}"
    return str(v)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    head = [tables.HEADERS.get(k, k) for k in tables.COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(k, row[k]) for k in tables.COLUMNS) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------- reading


def load_runs(root: Path, matrix: Matrix) -> list[CellRun]:
    """Every done cell's records, in the matrix's order."""
    return [
        CellRun.of(cell, read_metrics(cell_dir(root, cell) / "metrics.jsonl"))
        for cell in matrix.cells
        if cell_done(root, cell)
    ]


def load_transfers(root: Path, matrix: Matrix) -> dict[tuple[str, str, int, str], dict[str, Any]]:
    """Table 3's saved evaluations made with the SA-RL run that is there now."""
    return {
        t.key: json.loads(transfer_path(root, t).read_text())
        for t in matrix.transfers
        if transfer_done(root, t)
    }


# ---------------------------------------------------------------- writing


def write_report(
    root: Path, out_dir: Path | None = None, chi2: str = "auto"
) -> dict[str, Path]:
    """Every table (CSV + Markdown), figure (PNG) and `index.html`; name -> path. The keys
    `markdown`, `csv` and `png` are Table 1's Markdown, the paper's Table 1 layout as CSV
    and Fig. 3, what the report held before it had the rest."""
    if chi2 not in tables.CHI2_CHOICES:
        raise SpecError(f"--chi2: one of {', '.join(tables.CHI2_CHOICES)} (got {chi2!r})")
    matrix = saved_matrix(root)
    out = out_dir or root / "report"
    out.mkdir(parents=True, exist_ok=True)
    runs = load_runs(root, matrix)
    done = len(runs)
    paths: dict[str, Path] = {}
    sections: list[Section] = []

    def emit(name: str, title: str, notes: list[str], rows: list[dict[str, Any]],
             columns: tuple[str, ...], extra_md: str = "") -> Section:  # fmt: skip
        write_csv(out / f"{name}.csv", rows, columns)
        body = md_table(rows, columns) if rows else "_no rows yet_"
        text = f"# {title}\n\n" + "".join(f"{n}\n\n" for n in notes) + body + "\n" + extra_md
        (out / f"{name}.md").write_text(text)
        paths[f"{name}.csv"], paths[f"{name}.md"] = out / f"{name}.csv", out / f"{name}.md"
        sections.append(Section(name, title, notes, rows, columns))
        return sections[-1]

    status = f"{done}/{len(matrix.cells)} cells done"
    t1 = tables.table1(runs)
    wide = tables.table_rows(load_curves(root, matrix))
    write_csv(out / "table1_paper.csv", wide, tables.COLUMNS)
    paths["table1_paper.csv"] = out / "table1_paper.csv"
    drops = sorted({c.spec.alarms.cliff_drop for c in matrix.cells})
    paper_note = (
        "Peak validation accuracy; residual = peak − SA-RL peak; cliff = final − peak; "
        "IP = isolated policies, SP = shared policy (also `table1_paper.csv`). validation: "
        "how validation decoded (sampled at the rollout temperature with a seed per problem "
        "and slot, the same at every checkpoint; or greedy, `sampling.val_temperature: 0`)."
    )
    section = emit(
        "table1",
        f"Table 1: validation accuracy per cell ({matrix.name}, {status})",
        [
            "Base: the cell's own workflow untrained (its step-0 validation, every adapter at "
            "version 0 = the base model). Peak and peak_step: the best validation at steps >= 1 "
            "and the first step reaching it; final: the last validation; delta_peak, "
            "delta_final: against Base. vs_sa_rl: peak minus the block's SA-RL peak (the "
            "paper's residual). The sa_rl rows are the single-agent RL control (once per task, "
            "model and seed); the base_model row is the single-agent base model.",
            "cliff (marl's flag, not the paper's): 1 when final is at least `cliff_drop` "
            f"(the cell's `alarms.cliff_drop`, here {', '.join(map(str, drops))}) below peak.",
            "val_decoding: `sampled T=t` validates at the rollout temperature (or "
            "`sampling.val_temperature`), each turn seeded by the problem, the role and the "
            "slot, never the step: parallel slots write different texts and every checkpoint "
            "is read on the same draws; `greedy`: `sampling.val_temperature: 0`.",
        ],
        t1,
        tables.TABLE1,
        f"\n## The paper's layout: IP and SP side by side\n\n{paper_note}\n\n"
        + markdown_table(wide)
        + "\n",
    )
    section.subtables.append(
        ("The paper's layout: IP and SP side by side", paper_note, wide, tables.COLUMNS)
    )
    t2 = tables.table2(runs, chi2)
    emit(
        "table2",
        f"Table 2: per-role training dynamics, peak over first ({status})",
        [
            f"χ² series: `{chi2}`; chi2_metric names the one read for each cell. `auto` reads "
            "the paper's `chi2_token` unless every value of it stayed within the cell's "
            "`alarms.chi2_noise_floor` (learner and sampler computing the same float32 "
            "logits: ρ is 1 to rounding), and marl's `update_chi2` (how far the policy moved "
            "in the step) then; `--chi2 chi2_token` or `--chi2 update_chi2` reads one for "
            f"every cell, and a `chi2_token` at its noise floor gets no ratio (`{tables.NOISE}`). "
            "Each ratio is the series' maximum over the run over its first logged value "
            "(blank when that is 0 or the run did not log the series); chi2_peak_step is the "
            "step of the χ² maximum. Rows per role from `role/<role>/...`; a shared adapter "
            "adds one row named after it from `policy/<adapter>/...` (the paper's "
            "shared-policy row). grad_norm: each optimizer step's gradient norm, averaged "
            "over the step's optimizer steps of the adapter (verl's `actor/grad_norm`), for a "
            "role's part and for a whole adapter alike, under IP and SP.",
        ],
        t2,
        tables.TABLE2,
    )
    expected = [t.key for t in matrix.transfers]
    results = load_transfers(root, matrix)
    t3 = tables.table3(expected, results, t1)
    notes3 = [
        "The SA-RL control's final adapter on each workflow's generator role (Orch-Workers' "
        "workers, having no generator: the role column), the base model on every other role "
        "(paper Table 3). transfer: that workflow's validation accuracy; "
        "sa_rl_final: the SA-RL run's own validation at the checkpoint deployed; "
        "workflow_base: the workflow's untrained accuracy (Table 1's Base)."
    ]
    if not expected:
        notes3.append("This matrix has no SA-RL control or no workflow with a generator role.")
    elif not results:
        notes3.append(
            "**No Table 3 evaluation found**: `marl matrix` runs them on its cluster once the "
            "cells are done (with `--learner`, pass `--redis` too); run it again to add them."
        )
    emit("table3", f"Table 3: SA-RL generator transfer ({len(results)}/{len(expected)} "
         "evaluated)", notes3, t3, tables.TABLE3)  # fmt: skip
    sizes = sorted({c.spec.train.val_problems for c in matrix.cells})
    for st in tables.SIGNATURE_TABLES:
        emit(
            f"table{st.number}",
            f"Table {st.number}: trajectory signatures, {st.title}",
            [
                "Each trained cell of the workflow at its first (step 0), peak and final "
                "validation checkpoints; values are the validator's `val/sig/<role>/...` "
                "over that checkpoint's validation transcripts (marl/diagnostics/signatures.py),"
                " blank where not logged. "
                f"Problems per checkpoint: train.val_problems = {', '.join(map(str, sizes))} "
                "(the paper reads 100).",
            ],
            tables.signature_rows(runs, st),
            tables.signature_columns(st),
        )
    kinds = {r.cell.name: _kind(r) for r in runs}
    figs = {
        "fig2": ("Fig. 2: per-cell Δ validation accuracy against the cell's own base",
                 lambda p: figures.fig2(t1, kinds, p)),
        "fig3": ("Fig. 3: IP vs. SP peak validation accuracy on matched cells",
                 lambda p: figures.plot_scatter(wide, p)),
        "fig4": ("Fig. 4: IP vs. SP training success and validation accuracy per workflow",
                 lambda p: figures.fig4(runs, p)),
        "fig5": ("Fig. 5: max χ², max adapter gradient norm and entropy collapse depth per "
                 "matched cell", lambda p: figures.fig5(runs, chi2, p)),
        "fig6": ("Fig. 6: (a) IP per-role χ² / perplexity over first value, (b) SP per-role "
                 "and global diagnostics over first value, (c) IP vs. SP validation overlay",
                 lambda p: figures.fig6(runs, chi2, p)),
    }  # fmt: skip
    for name, (_, draw) in figs.items():
        draw(out / f"{name}.png")
        paths[f"{name}.png"] = out / f"{name}.png"
    index = out / "index.html"
    index.write_text(_html(matrix, status, chi2, sections, {k: v[0] for k, v in figs.items()}))
    paths["index.html"] = index
    paths.update(markdown=out / "table1.md", csv=out / "table1_paper.csv", png=out / "fig3.png")
    return paths


def _kind(run: CellRun) -> str | None:
    if run.cell.kind == tables.SA_RL_CONTROL:
        return "sa_rl"
    return tables.policy_kind(run.cell)


@dataclass
class Section:
    """One table of the page."""

    name: str
    title: str
    notes: list[str]
    rows: list[dict[str, Any]]
    columns: tuple[str, ...]
    subtables: list[tuple[str, str, list[dict[str, Any]], tuple[str, ...]]] = field(
        default_factory=list
    )
    """(heading, note, rows, columns) shown under the table."""


CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; font-size: 12px; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: 2px 6px; text-align: right; white-space: nowrap; }
th { background: #f3f3f3; position: sticky; top: 0; }
td.t { text-align: left; }
.scroll { overflow-x: auto; max-width: 100%; }
img { max-width: 100%; border: 1px solid #ddd; margin: 0.5em 0 1.5em; }
p.note { max-width: 70em; font-size: 13px; color: #444; }
"""


def _html_table(rows: list[dict[str, Any]], columns: tuple[str, ...]) -> str:
    if not rows:
        return "<p><em>no rows yet</em></p>"
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = []
    for row in rows:
        cells = []
        for c in columns:
            v = row.get(c)
            cls = "" if isinstance(v, int | float) else ' class="t"'
            cells.append(f"<td{cls}>{html.escape(_md_value(c, v))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f'<div class="scroll"><table><tr>{head}</tr>{"".join(body)}</table></div>'


def _html(matrix: Matrix, status: str, chi2: str, sections: list[Section],
          figs: dict[str, str]) -> str:  # fmt: skip
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(matrix.name)}: matrix report</title><style>{CSS}</style>",
        f"</head><body><h1>{html.escape(matrix.name)}: the paper's analysis</h1>",
        f"<p class='note'>{html.escape(status)}; χ² series {html.escape(chi2)}. Every table is "
        "also a CSV and a Markdown file beside this page. Contents: "
        + ", ".join(f"<a href='#{s.name}'>{s.name}</a>" for s in sections)
        + ", "
        + ", ".join(f"<a href='#{n}'>{n}</a>" for n in figs)
        + ".</p>",
    ]
    for s in sections:
        parts.append(f"<h2 id='{s.name}'>{html.escape(s.title)}</h2>")
        parts += [f"<p class='note'>{html.escape(n)}</p>" for n in s.notes]
        parts.append(
            f"<p class='note'><a href='{s.name}.csv'>{s.name}.csv</a> · "
            f"<a href='{s.name}.md'>{s.name}.md</a></p>"
        )
        parts.append(_html_table(s.rows, s.columns))
        for heading, note, rows, columns in s.subtables:
            parts.append(f"<h3>{html.escape(heading)}</h3><p class='note'>{html.escape(note)}</p>")
            parts.append(_html_table(rows, columns))
    for name, title in figs.items():
        parts.append(f"<h2 id='{name}'>{html.escape(title)}</h2>")
        parts.append(f"<img src='{name}.png' alt='{html.escape(title)}'>")
    parts.append("</body></html>")
    return "\n".join(parts)
