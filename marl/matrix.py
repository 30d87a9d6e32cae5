"""`marl matrix`: the paper's experiment as one command, and its Table 1 and Fig. 3.

A matrix file holds a base run spec and axes:

    name: demo-matrix
    base: {train: {steps: 40}, ...}          # any RunSpec fields (dotted overrides work too)
    axes:
      workflow: [voting, eval_opt]
      policy: [shared, isolated]           # SP and IP
      task: [arithmetic]                   # data.train = data.val
      model: [demo]                        # model.path; `demo` is the shipped demo model
      seed: [0]
    controls: {base: true, sa_rl: true}

It expands to one run per combination of the axes plus, per (task, model, seed), two
controls: the base model (evaluation only: every role served by the base model, workflow
`single`) and single-agent RL (workflow `single`, the same step budget). Each cell's
outputs go to `DIR/cells/<cell>/` (the run's own `metrics.jsonl`, checkpoints, ...); a cell
is done once `cell.json` there says SUCCEEDED and its `metrics.jsonl` exists, so running
the same matrix again redoes only the cells that are not (a half-written one starts over).

`marl matrix report DIR` reads the cells' `metrics.jsonl` into Table 1 (Markdown + CSV)
and the Fig. 3 scatter (IP vs. SP peak accuracy per workflow).
"""

from __future__ import annotations

import csv
import itertools
import json
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import yaml

from marl.config import RunSpec, SpecError, apply_overrides, parse_spec
from marl.workflows.routing import adapter_versions_in_flight

AXES = ("task", "model", "workflow", "policy", "seed")
"""Axis names a matrix may have; every other key of `axes` is refused."""
CONTROL_WORKFLOW = "single"
BASE_CONTROL = "base"
SA_RL_CONTROL = "sa_rl"


@dataclass(frozen=True)
class Cell:
    name: str
    kind: str
    """`run`, `base` (evaluation-only control) or `sa_rl` (single-agent RL control)."""
    task: str
    model: str
    seed: int
    workflow: str
    policy: str
    spec: RunSpec = field(compare=False, hash=False)


@dataclass
class Matrix:
    name: str
    raw: dict[str, Any]
    cells: list[Cell]


def _model_path(value: str) -> str:
    if value == "demo":
        from marl.demo_model import demo_model_dir

        return str(demo_model_dir())
    return value


def _tag(value: Any) -> str:
    text = Path(str(value)).name if "/" in str(value) else str(value)
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in text)


def load_matrix(source: str | Path | dict[str, Any]) -> Matrix:
    """Read and expand a matrix file (or mapping); SpecError names the bad field."""
    if isinstance(source, dict):
        raw = source
    else:
        path = Path(source)
        if not path.is_file():
            raise SpecError(f"matrix file {str(path)!r} does not exist")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise SpecError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise SpecError("a matrix must be a mapping with `base`, `axes` and optionally `controls`")
    unknown = sorted(set(raw) - {"name", "base", "axes", "controls"})
    if unknown:
        raise SpecError(f"matrix: unknown field(s) {', '.join(unknown)}; use name, base, axes, "
                        "controls")
    base = raw.get("base") or {}
    if isinstance(base, list):
        base = apply_overrides({}, [str(x) for x in base])
    if not isinstance(base, dict):
        raise SpecError("field `base`: a run spec mapping (or a list of a.b=value overrides)")
    axes = raw.get("axes") or {}
    if not isinstance(axes, dict):
        raise SpecError("field `axes`: a mapping of axis name to a list of values")
    bad = sorted(set(axes) - set(AXES))
    if bad:
        raise SpecError(f"field `axes`: unknown axis {', '.join(bad)}; axes are {', '.join(AXES)}")
    values: dict[str, list[Any]] = {}
    for axis in AXES:
        v = axes.get(axis)
        if v is None:
            values[axis] = [_default(base, axis)]
        elif not isinstance(v, list) or not v:
            raise SpecError(f"field `axes.{axis}`: a non-empty list of values")
        else:
            values[axis] = v
    controls = {BASE_CONTROL: True, SA_RL_CONTROL: True, **(raw.get("controls") or {})}
    bad = sorted(set(controls) - {BASE_CONTROL, SA_RL_CONTROL})
    if bad:
        raise SpecError(f"field `controls`: unknown control {', '.join(bad)}; use base, sa_rl")
    name = str(raw.get("name") or "matrix")
    cells: list[Cell] = []
    for task, model, seed in itertools.product(values["task"], values["model"], values["seed"]):
        prefix = f"{_tag(task)}-{_tag(model)}-s{seed}"
        for kind in (BASE_CONTROL, SA_RL_CONTROL):
            if controls[kind]:
                cells.append(_cell(f"{prefix}-{kind}", kind, base, task, model, int(seed),
                                   CONTROL_WORKFLOW, "shared"))
        for workflow, policy in itertools.product(values["workflow"], values["policy"]):
            cells.append(_cell(f"{prefix}-{_tag(workflow)}-{_tag(policy)}", "run", base, task,
                               model, int(seed), str(workflow), str(policy)))
    return Matrix(name, raw, cells)


def _default(base: dict[str, Any], axis: str) -> Any:
    spec = parse_spec(dict(base))
    if axis == "task":
        return spec.data.train
    if axis == "model":
        return spec.model.path
    return getattr(spec, axis)


def _cell(name: str, kind: str, base: dict[str, Any], task: Any, model: Any, seed: int,
          workflow: str, policy: str) -> Cell:
    data = apply_overrides(base, [
        f"data.train={task}", f"data.val={task}", f"model.path={_model_path(str(model))}",
        f"seed={seed}", f"workflow={workflow}", f"policy={policy}", f"name={name[:64]}",
    ])
    try:
        spec = parse_spec(data)
    except SpecError as err:
        raise SpecError(f"matrix cell {name}: {err}") from None
    return Cell(name, kind, str(task), str(model), seed, workflow, policy, spec)


# ---------------------------------------------------------------- the matrix directory


def cell_dir(root: Path, cell: Cell) -> Path:
    return root / "cells" / cell.name


def cell_done(root: Path, cell: Cell) -> bool:
    d = cell_dir(root, cell)
    marker = d / "cell.json"
    if not marker.is_file() or not (d / "metrics.jsonl").is_file():
        return False
    return bool(json.loads(marker.read_text()).get("state") == "SUCCEEDED")


def _mark(root: Path, cell: Cell, state: str, **extra: Any) -> None:
    d = cell_dir(root, cell)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / ".cell.json.tmp"
    tmp.write_text(json.dumps({"cell": cell.name, "kind": cell.kind, "state": state, **extra}))
    tmp.replace(d / "cell.json")


def prepare(root: Path, matrix: Matrix) -> None:
    """Create DIR (or check that it holds this matrix) and record the matrix in it."""
    root.mkdir(parents=True, exist_ok=True)
    saved = root / "matrix.yaml"
    if saved.is_file():
        if yaml.safe_load(saved.read_text()) != matrix.raw:
            raise SpecError(
                f"--out: {root} holds another matrix (its matrix.yaml differs); "
                "choose another directory or restore that matrix file"
            )
    else:
        saved.write_text(yaml.safe_dump(matrix.raw, sort_keys=False))


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def status_lines(root: Path, matrix: Matrix) -> list[str]:
    """One line per cell: done / partial / pending, its last step and validation accuracy."""
    lines = []
    for cell in matrix.cells:
        d = cell_dir(root, cell)
        metrics = d / "metrics.jsonl"
        rows = read_metrics(metrics) if metrics.is_file() else []
        state = "done" if cell_done(root, cell) else ("partial" if rows else "pending")
        if (d / "cell.json").is_file() and state != "done":
            recorded = json.loads((d / "cell.json").read_text())
            if recorded.get("state") in ("FAILED", "CANCELLED"):
                state = recorded["state"].lower()
            elif recorded.get("run_id"):
                state = f"{state} (run {recorded['run_id']})"
        vals = [r for r in rows if "val/accuracy" in r]
        last = f"step {rows[-1]['step']}/{cell.spec.train.steps}" if rows else ""
        acc = f"val {vals[-1]['val/accuracy']:.3f}" if vals else ""
        lines.append(f"{cell.name:<40} {state:<9} {last:<12} {acc}".rstrip())
    return lines


def run_matrix(
    matrix: Matrix,
    root: Path,
    learner: str | None = None,
    redis_url: str | None = None,
    out: TextIO = sys.stdout,
) -> int:
    """Run every cell that is not done, one after another: on an embedded cluster (one per
    model), or on the cluster whose learner is `learner` (the base-model control then needs
    that cluster's `redis_url`). 0 when every cell succeeded."""
    prepare(root, matrix)
    todo = [c for c in matrix.cells if not cell_done(root, c)]
    out.write(f"marl matrix {matrix.name}: {len(matrix.cells)} cells, "
              f"{len(matrix.cells) - len(todo)} done, {len(todo)} to run -> {root}\n")
    if not todo:
        return 0
    if learner is not None:
        if redis_url is None and any(c.kind == BASE_CONTROL for c in todo):
            raise SpecError("--redis: the base-model control evaluates on the cluster's workers; "
                            "pass the cluster's Redis URL with --redis, or run embedded")
        failed = _run_cells(todo, root, matrix, learner, redis_url, out)
        return 1 if failed else 0
    from marl.launcher import Cluster

    failed = 0
    for model in dict.fromkeys(c.model for c in todo):
        cells = [c for c in todo if c.model == model]
        spec = cells[0].spec
        started = time.monotonic()
        cluster = Cluster(root / "cluster", spec.model.path, engine=_engine(spec),
                          max_lora_rank=max(c.spec.lora.rank for c in cells),
                          max_loras=max(adapter_versions_in_flight(c.spec) for c in cells))
        endpoints = cluster.start()
        out.write(f"cluster up in {time.monotonic() - started:.0f}s (model {model})\n")
        try:
            failed += _run_cells(cells, root, matrix, endpoints["learner"],
                                 str(endpoints["redis"]), out)
        finally:
            cluster.stop()
    return 1 if failed else 0


def _engine(spec: RunSpec) -> str:
    if spec.engine != "auto":
        return spec.engine
    from services.inference.factory import vllm_available

    return "vllm" if vllm_available() else "transformers"


def _run_cells(cells: list[Cell], root: Path, matrix: Matrix, learner: str,
               redis_url: str | None, out: TextIO) -> int:
    from marl.clients.runs import RunsClient

    failed = 0
    total = len(matrix.cells)
    with RunsClient(learner) as runs:
        for cell in cells:
            index = matrix.cells.index(cell) + 1
            d = cell_dir(root, cell)
            started = time.monotonic()
            out.write(f"[{index}/{total}] {cell.name}: ")
            out.flush()
            adopted = _live_run(runs, d) if cell.kind != BASE_CONTROL else None
            if adopted is None:
                shutil.rmtree(d, ignore_errors=True)  # a half-finished cell starts over
                d.mkdir(parents=True)
            cell.spec.out_dir = str(d.resolve())
            if cell.kind == BASE_CONTROL:
                assert redis_url is not None
                state, info = _run_base(cell, d, redis_url)
            else:
                state, info = _run_training(cell, runs, out, root, adopted)
            seconds = time.monotonic() - started
            _mark(root, cell, state, seconds=round(seconds, 1), **info)
            if state != "SUCCEEDED":
                failed += 1
            rows = read_metrics(d / "metrics.jsonl") if (d / "metrics.jsonl").is_file() else []
            vals = [r["val/accuracy"] for r in rows if "val/accuracy" in r]
            peak = f", peak val {max(vals):.3f}" if vals else ""
            error = f": {info['error']}" if info.get("error") and state != "SUCCEEDED" else ""
            out.write(f"{state} in {seconds:.0f}s{peak}{error}\n")
            out.flush()
    return failed


def _run_base(cell: Cell, d: Path, redis_url: str) -> tuple[str, dict[str, Any]]:
    from marl.config import dump_spec
    from marl.evaluate import AdapterSource, evaluate_sync
    from marl.workflows.routing import policy_of_role

    (d / "run.yaml").write_text(dump_spec(cell.spec))
    routing = {role: AdapterSource(None) for role in policy_of_role(cell.spec)}
    metrics = evaluate_sync(cell.spec, routing, redis_url, step=0)
    (d / "metrics.jsonl").write_text(json.dumps({"step": 0, **metrics, "alarms": []}) + "\n")
    if metrics["val/episode_errors"] == metrics["val/problems"]:
        return "FAILED", {"error": f"every episode failed: {metrics['val/first_episode_error']}"}
    return "SUCCEEDED", {}


def _live_run(runs: Any, d: Path) -> str | None:
    """The run a previous `marl matrix` submitted for this cell, if this cluster still knows
    it and it has not failed (a matrix killed while a cluster ran its cell): follow it
    instead of starting the cell over."""
    from marl.clients.runs import RunNotFound

    marker = d / "cell.json"
    if not marker.is_file():
        return None
    run_id = json.loads(marker.read_text()).get("run_id")
    if not run_id:
        return None
    try:
        run = runs.get(run_id)
    except RunNotFound:
        return None
    return str(run_id) if run.state in ("QUEUED", "RUNNING", "SUCCEEDED") else None


def _run_training(cell: Cell, runs: Any, out: TextIO, root: Path,
                  adopted: str | None) -> tuple[str, dict[str, Any]]:
    run_id = adopted or runs.submit(cell.spec)
    _mark(root, cell, "RUNNING", run_id=run_id)
    out.write(f"run {run_id}{' (resumed following it)' if adopted else ''} ")
    out.flush()
    last = -1
    for event in runs.watch(run_id):
        step = event.run.step
        if event.metrics is not None and step != last:
            last = step
            out.write(".")
            out.flush()
    run = runs.get(run_id)
    out.write(" ")
    return run.state, {"run_id": run_id, "error": run.error}


# ---------------------------------------------------------------- Table 1


@dataclass(frozen=True)
class Curve:
    """The validation-accuracy curve of one run and what Table 1 reads off it."""

    steps: list[int]
    accuracy: list[float]
    alarms: list[str]

    @property
    def peak(self) -> float:
        return max(self.accuracy)

    @property
    def peak_step(self) -> int:
        """The first step at which the peak was reached."""
        return self.steps[self.accuracy.index(self.peak)]

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
    alarms: list[str] = []
    for r in rows:
        if r.get("val/accuracy") is not None:
            by_step[int(r["step"])] = float(r["val/accuracy"])
        alarms += [f"step {r['step']}: {a}" for a in r.get("alarms") or []]
        if r.get("guard"):
            alarms.append(f"step {r['step']}: guard {r['guard']}")
    if not by_step:
        return None
    steps = sorted(by_step)
    return Curve(steps, [by_step[s] for s in steps], list(dict.fromkeys(alarms)))


COLUMNS = (
    "task", "model", "seed", "workflow", "base", "sa_rl", "ip_peak", "sp_peak",
    "ip_residual", "sp_residual", "ip_final", "sp_final", "ip_cliff", "sp_cliff",
    "ip_peak_step", "sp_peak_step", "ip_alarms", "sp_alarms",
)
POLICY_COLUMN = {"isolated": "ip", "shared": "sp"}


def table_rows(curves: dict[Cell, Curve | None]) -> list[dict[str, Any]]:
    """Table 1: one row per (task, model, seed, workflow): the base and SA-RL controls, IP and
    SP peak accuracy, their residuals against SA-RL (peak - SA-RL peak), final accuracy, cliff
    depth (final - peak), step of the peak and alarms. Missing cells leave blanks."""
    rows: dict[tuple[str, str, int, str], dict[str, Any]] = {}
    controls: dict[tuple[str, str, int], dict[str, float]] = {}
    for cell, c in curves.items():
        if cell.kind != "run" and c is not None:
            # the base control is its single evaluation; SA-RL is read at its peak
            controls.setdefault((cell.task, cell.model, cell.seed), {})[cell.kind] = (
                c.final if cell.kind == BASE_CONTROL else c.peak)
    for cell, c in curves.items():
        if cell.kind != "run":
            continue
        key = (cell.task, cell.model, cell.seed, cell.workflow)
        ctl = controls.get(key[:3], {})
        row = rows.setdefault(key, {
            "task": cell.task, "model": cell.model, "seed": cell.seed,
            "workflow": cell.workflow, "base": ctl.get(BASE_CONTROL),
            "sa_rl": ctl.get(SA_RL_CONTROL),
        })
        p = POLICY_COLUMN.get(cell.policy)
        if p is None or c is None:
            continue
        row[f"{p}_peak"] = c.peak
        row[f"{p}_final"] = c.final
        row[f"{p}_cliff"] = c.cliff
        row[f"{p}_peak_step"] = c.peak_step
        row[f"{p}_alarms"] = c.alarms
        if row["sa_rl"] is not None:
            row[f"{p}_residual"] = c.peak - row["sa_rl"]
    return [{k: row.get(k) for k in COLUMNS} for row in rows.values()]


def load_curves(root: Path, matrix: Matrix) -> dict[Cell, Curve | None]:
    """The curve of every done cell (cells not done are left out)."""
    return {
        cell: curve(read_metrics(cell_dir(root, cell) / "metrics.jsonl"))
        for cell in matrix.cells if cell_done(root, cell)
    }


def _fmt(key: str, v: Any, markdown: bool) -> str:
    if v is None:
        return "" if not markdown else "–"
    if key.endswith("alarms"):
        if markdown:
            return f"{len(v)}: " + "; ".join(v[:3]) + (" …" if len(v) > 3 else "") if v else "0"
        return " | ".join(v)
    if isinstance(v, float):
        sign = "+" if key.endswith(("residual", "cliff")) and v > 0 else ""
        return f"{sign}{v:.3f}" if markdown else repr(v)
    return str(v)


HEADERS = {
    "base": "Base", "sa_rl": "SA-RL", "ip_peak": "IP peak", "sp_peak": "SP peak",
    "ip_residual": "IP − SA-RL", "sp_residual": "SP − SA-RL", "ip_final": "IP final",
    "sp_final": "SP final", "ip_cliff": "IP cliff", "sp_cliff": "SP cliff",
    "ip_peak_step": "IP peak step", "sp_peak_step": "SP peak step",
    "ip_alarms": "IP alarms", "sp_alarms": "SP alarms",
}


def markdown_table(rows: list[dict[str, Any]]) -> str:
    head = [HEADERS.get(k, k) for k in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(k, row[k], True) for k in COLUMNS) + " |")
    return "\n".join(lines)


def write_report(root: Path, out_dir: Path | None = None) -> dict[str, Path]:
    """Table 1 (table1.md, table1.csv) and Fig. 3 (fig3.png) of the matrix in `root`."""
    saved = root / "matrix.yaml"
    if not saved.is_file():
        raise SpecError(f"{root}: no matrix.yaml; pass the --out directory of `marl matrix`")
    matrix = load_matrix(yaml.safe_load(saved.read_text()))
    out_dir = out_dir or root / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = table_rows(load_curves(root, matrix))
    done = sum(cell_done(root, c) for c in matrix.cells)
    md = out_dir / "table1.md"
    md.write_text(
        f"# {matrix.name}: Table 1 ({done}/{len(matrix.cells)} cells done)\n\n"
        "Peak validation accuracy; residual = peak − SA-RL peak; cliff = final − peak; "
        "IP = isolated policies, SP = shared policy.\n\n" + markdown_table(rows) + "\n"
    )
    csv_path = out_dir / "table1.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        for row in rows:
            writer.writerow([_fmt(k, row[k], False) for k in COLUMNS])
    png = out_dir / "fig3.png"
    plot_scatter(rows, png)
    return {"markdown": md, "csv": csv_path, "png": png}


def plot_scatter(rows: list[dict[str, Any]], path: Path) -> None:
    """Fig. 3: IP vs. SP peak accuracy per cell, with the diagonal (IP = SP)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 5.0))
    pts = [r for r in rows if r["ip_peak"] is not None and r["sp_peak"] is not None]
    vals = [v for r in pts for v in (r["ip_peak"], r["sp_peak"])] or [0.0, 1.0]
    lo, hi = max(0.0, min(vals) - 0.05), min(1.0, max(vals) + 0.05)
    ax.plot([lo, hi], [lo, hi], color="0.6", lw=1, ls="--", label="IP = SP")
    for r in pts:
        ax.scatter(r["sp_peak"], r["ip_peak"], s=36, clip_on=False)
        ax.annotate(f"{r['workflow']} / {r['task']}", (r["sp_peak"], r["ip_peak"]),
                    textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("SP peak validation accuracy")
    ax.set_ylabel("IP peak validation accuracy")
    ax.set_title("IP vs. SP per cell (above the diagonal: IP better)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
