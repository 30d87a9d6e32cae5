"""`marl matrix`: the paper's experiment as one command, resumable.

A matrix file holds a base run spec and axes:

    name: paper
    base: {train: {steps: 500}, ...}       # any RunSpec fields (dotted overrides work too)
    axes:
      task:                                # a dataset name sets data.train = data.val ...
        - arithmetic
        - {name: math, data: {train: dapo_math, train_path: /data/dapo.parquet}}
        - {name: code, data: {train: deepcoder}, sampling: {max_tokens: 2048}}
      model:                               # ... a model path (`demo`: the shipped one) ...
        - demo
        - {name: qwen3-4b, model: {path: Qwen/Qwen3-4B, dtype: bfloat16},
           grpo: {max_tokens_per_micro_batch: 8192}}
      workflow: [single, voting, eval_opt, orch_workers]
      policy: [shared, isolated]           # SP and IP
      seed: [0]
    controls: {base: true, sa_rl: true}

An axis value is a plain name or a mapping: its `name` (what tables and cell names show)
and any run spec fields it sets, so one file holds the paper's whole matrix, each task with
its data and caps and each scale with its dtype and micro-batch budget. A task mapping that
sets `data.train` and not `data.val` validates on the same dataset; a workflow or policy
mapping that does not set `workflow` / `policy` takes its name. Values merge into `base` in
axis order (task, model, workflow, policy, seed), later ones winning.

It expands to one run per combination of the axes plus, per (task, model, seed), two
controls: the base model (evaluation only: every role served by the base model, workflow
`single`) and single-agent RL (workflow `single`, the same step budget). Each cell's
outputs go to `DIR/cells/<cell>/` (the run's own `metrics.jsonl`, checkpoints, ...); a cell
is done once `cell.json` there says SUCCEEDED and its `metrics.jsonl` exists, so running
the same matrix again redoes only the cells that are not (a half-written one starts over).
`--parallel N` runs up to N cells at once: the embedded cluster's learner then trains N
runs at once (`learner.max_concurrent_runs`), and inference and workers serve them all.

Once a block's SA-RL cell is done, its final adapter is dropped onto the generator role of
each of the block's workflows (Orch-Workers' workers: marl/experiments/evaluate.py `solver_role`), every
other role on the base model, and the workflow is validated (paper Table 3): `DIR/transfer/<block>-<workflow>.json`, written when done and
skipped on a rerun like a cell.

`marl matrix report DIR` (marl/experiments/matrix_report.py) turns the cells into the paper's tables and
figures.
"""

from __future__ import annotations

import itertools
import json
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import yaml

from marl.experiments.matrix_tables import (
    BASE_CONTROL,
    CONTROL_WORKFLOW,
    SA_RL_CONTROL,
    Curve,
    curve,
)
from marl.models.engines import resolve_engine
from marl.spec.run import RunSpec, SpecError, apply_overrides, parse_spec
from marl.workflows.routing import adapter_versions_in_flight, policy_of_role

AXES = ("task", "model", "workflow", "policy", "seed")
"""Axis names a matrix may have, in the order their values merge; any other key of `axes`
is refused."""


@dataclass(frozen=True)
class AxisValue:
    name: str
    fields: dict[str, Any]
    """The run spec fields this value sets (nested, like a spec)."""


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


@dataclass(frozen=True)
class Transfer:
    """Table 3's evaluation for one workflow of a (task, model, seed) block: the block's
    SA-RL adapter on the generator, the base model on every other role."""

    task: str
    model: str
    seed: int
    workflow: str
    spec: RunSpec = field(compare=False, hash=False)
    """A run cell's spec of that workflow (only the roles' routing differs)."""
    sa_rl: Cell = field(compare=False, hash=False)

    @property
    def key(self) -> tuple[str, str, int, str]:
        return (self.task, self.model, self.seed, self.workflow)

    @property
    def name(self) -> str:
        return f"{_block(self.task, self.model, self.seed)}-{_tag(self.workflow)}"


@dataclass
class Matrix:
    name: str
    raw: dict[str, Any]
    cells: list[Cell]
    transfers: list[Transfer] = field(default_factory=list)


def _model_path(value: str) -> str:
    if value == "demo":
        from marl.models.demo import demo_model_dir

        return str(demo_model_dir())
    return value


def _tag(value: Any) -> str:
    text = Path(str(value)).name if "/" in str(value) else str(value)
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in text)


def _block(task: str, model: str, seed: int) -> str:
    return f"{_tag(task)}-{_tag(model)}-s{seed}"


def _merge(into: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    out = dict(into)
    for k, v in more.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _plain(axis: str, value: Any) -> dict[str, Any]:
    """The fields a plain (non-mapping) axis value sets."""
    if axis == "task":
        return {"data": {"train": value, "val": value}}
    if axis == "model":
        return {"model": {"path": _model_path(str(value))}}
    return {axis: value}


def _axis_value(axis: str, i: int, value: Any, base: dict[str, Any]) -> AxisValue:
    where = f"axes.{axis}[{i}]"
    if axis == "seed":
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(f"field `{where}`: a seed is an integer (got {value!r})")
        return AxisValue(str(value), {"seed": value})
    if not isinstance(value, dict):
        if not isinstance(value, str | int | float) or isinstance(value, bool) or value == "":
            raise SpecError(f"field `{where}`: a name or a mapping with `name` (got {value!r})")
        out = AxisValue(str(value), _plain(axis, value))
    else:
        name = value.get("name")
        if not isinstance(name, str) or not name.strip():
            raise SpecError(
                f"field `{where}.name`: a mapping axis value needs a `name` (what tables and "
                f"cell names show), e.g. {{name: {axis}-1, ...}}"
            )
        fields = {k: v for k, v in value.items() if k != "name"}
        if axis in ("workflow", "policy"):
            fields.setdefault(axis, name)
        if axis == "task":
            data = fields.get("data")
            if isinstance(data, dict) and "train" in data and "val" not in data:
                fields["data"] = {**data, "val": data["train"]}
        if axis == "model":
            model = fields.get("model")
            if isinstance(model, dict) and isinstance(model.get("path"), str):
                fields["model"] = {**model, "path": _model_path(model["path"])}
        out = AxisValue(name, fields)
    try:
        parse_spec(_merge(base, out.fields))
    except SpecError as err:
        raise SpecError(f"field `{where}` ({out.name}): {err}") from None
    return out


def load_matrix(source: str | Path | dict[str, Any]) -> Matrix:  # noqa: C901, PLR0915 (older than the limit; split it when next changed)
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
        raise SpecError(
            f"matrix: unknown field(s) {', '.join(unknown)}; use name, base, axes, controls"
        )
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
    values: dict[str, list[AxisValue]] = {}
    for axis in AXES:
        v = axes.get(axis)
        if v is None:
            v = [_default(base, axis)]
        elif not isinstance(v, list) or not v:
            raise SpecError(f"field `axes.{axis}`: a non-empty list of values")
        values[axis] = [_axis_value(axis, i, x, base) for i, x in enumerate(v)]
        names = [x.name for x in values[axis]]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise SpecError(f"field `axes.{axis}`: two values named {', '.join(twice)}")
    controls = {BASE_CONTROL: True, SA_RL_CONTROL: True, **(raw.get("controls") or {})}
    bad = sorted(set(controls) - {BASE_CONTROL, SA_RL_CONTROL})
    if bad:
        raise SpecError(f"field `controls`: unknown control {', '.join(bad)}; use base, sa_rl")
    from marl.experiments.evaluate import solver_role

    name = str(raw.get("name") or "matrix")
    cells: list[Cell] = []
    transfers: list[Transfer] = []
    single = AxisValue(CONTROL_WORKFLOW, {"workflow": CONTROL_WORKFLOW})
    shared = AxisValue("shared", {"policy": "shared"})
    for task, model, seed in itertools.product(values["task"], values["model"], values["seed"]):
        prefix = _block(task.name, model.name, int(seed.name))
        sa_rl: Cell | None = None
        for kind in (BASE_CONTROL, SA_RL_CONTROL):
            if controls[kind]:
                cell = _cell(f"{prefix}-{kind}", kind, base, task, model, seed, single, shared)
                cells.append(cell)
                sa_rl = cell if kind == SA_RL_CONTROL else sa_rl
        for workflow, policy in itertools.product(values["workflow"], values["policy"]):
            cell = _cell(f"{prefix}-{_tag(workflow.name)}-{_tag(policy.name)}", "run", base,
                         task, model, seed, workflow, policy)  # fmt: skip
            cells.append(cell)
            if sa_rl is None or solver_role(cell.spec) is None:
                continue
            t = Transfer(cell.task, cell.model, cell.seed, cell.workflow, cell.spec, sa_rl)
            if all(x.key != t.key for x in transfers):
                transfers.append(t)
    return Matrix(name, raw, cells, transfers)


def _default(base: dict[str, Any], axis: str) -> Any:
    spec = parse_spec(dict(base))
    if axis == "task":
        return spec.data.train
    if axis == "model":
        return spec.model.path
    return getattr(spec, axis)


def _cell(
    name: str, kind: str, base: dict[str, Any], task: AxisValue, model: AxisValue,
    seed: AxisValue, workflow: AxisValue, policy: AxisValue,
) -> Cell:  # fmt: skip
    data = base
    for v in (task, model, workflow, policy, seed):
        data = _merge(data, v.fields)
    data = _merge(data, {"name": name[:64]})
    try:
        spec = parse_spec(data)
    except SpecError as err:
        raise SpecError(f"matrix cell {name}: {err}") from None
    return Cell(name, kind, task.name, model.name, spec.seed, workflow.name, policy.name, spec)


# ---------------------------------------------------------------- the matrix directory


def cell_dir(root: Path, cell: Cell) -> Path:
    return root / "cells" / cell.name


def cell_done(root: Path, cell: Cell) -> bool:
    d = cell_dir(root, cell)
    marker = d / "cell.json"
    if not marker.is_file() or not (d / "metrics.jsonl").is_file():
        return False
    return bool(json.loads(marker.read_text()).get("state") == "SUCCEEDED")


def transfer_path(root: Path, t: Transfer) -> Path:
    return root / "transfer" / f"{t.name}.json"


def transfer_done(root: Path, t: Transfer) -> bool:
    """Evaluated with the SA-RL run that is there now (a rerun SA-RL cell invalidates it)."""
    path = transfer_path(root, t)
    if not path.is_file() or not cell_done(root, t.sa_rl):
        return False
    run_id = json.loads((cell_dir(root, t.sa_rl) / "cell.json").read_text()).get("run_id")
    return bool(json.loads(path.read_text()).get("sa_rl_run_id") == run_id)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def _mark(root: Path, cell: Cell, state: str, **extra: Any) -> None:
    _write_json(
        cell_dir(root, cell) / "cell.json",
        {"cell": cell.name, "kind": cell.kind, "state": state, **extra},
    )


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


def saved_matrix(root: Path) -> Matrix:
    """The matrix `marl matrix` recorded in DIR."""
    saved = root / "matrix.yaml"
    if not saved.is_file():
        raise SpecError(f"{root}: no matrix.yaml; pass the --out directory of `marl matrix`")
    return load_matrix(yaml.safe_load(saved.read_text()))


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_curves(root: Path, matrix: Matrix) -> dict[Cell, Curve | None]:
    """The curve of every done cell (cells not done are left out)."""
    return {
        cell: curve(read_metrics(cell_dir(root, cell) / "metrics.jsonl"))
        for cell in matrix.cells
        if cell_done(root, cell)
    }


def status_lines(root: Path, matrix: Matrix) -> list[str]:
    """One line per cell: done / partial / pending, its last step and validation accuracy;
    then one per Table 3 evaluation."""
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
    for t in matrix.transfers:
        done = transfer_done(root, t)
        acc = ""
        if done:
            result = json.loads(transfer_path(root, t).read_text())
            acc = f"val {result['val/accuracy']:.3f}" if "val/accuracy" in result else ""
        name = f"table3/{t.name}"
        lines.append(f"{name:<40} {'done' if done else 'pending':<9} {'':<12} {acc}".rstrip())
    return lines


# ---------------------------------------------------------------- running


def run_matrix(
    matrix: Matrix,
    root: Path,
    learner: str | None = None,
    redis_url: str | None = None,
    out: TextIO = sys.stdout,
    parallel: int = 1,
) -> int:
    """Run every cell that is not done, up to `parallel` at once, then Table 3's
    evaluations: on an embedded cluster (one per model) whose learner trains `parallel`
    runs at once, or on the cluster whose learner is `learner` (the base-model control and
    Table 3 then need that cluster's `redis_url`; cells submitted beyond its
    `learner.max_concurrent_runs` wait in its queue). 0 when every cell and evaluation
    succeeded."""
    if parallel < 1:
        raise SpecError(f"--parallel: at least 1 cell at a time, got {parallel}")
    prepare(root, matrix)
    todo = [c for c in matrix.cells if not cell_done(root, c)]
    transfers = [t for t in matrix.transfers if not transfer_done(root, t)]
    extra = f" (+{len(transfers)} Table 3 evaluations)" if transfers else ""
    at_once = f", {parallel} at a time" if parallel > 1 else ""
    out.write(
        f"marl matrix {matrix.name}: {len(matrix.cells)} cells, "
        f"{len(matrix.cells) - len(todo)} done, {len(todo)} to run{at_once}{extra} -> {root}\n"
    )
    if not todo and not transfers:
        return 0
    if learner is not None:
        if redis_url is None and any(c.kind == BASE_CONTROL for c in todo):
            raise SpecError(
                "--redis: the base-model control evaluates on the cluster's workers; "
                "pass the cluster's Redis URL with --redis, or run embedded"
            )
        failed = _run_cells(todo, root, matrix, learner, redis_url, out, parallel)
        if redis_url is None:
            if transfers:
                out.write("Table 3 skipped: it evaluates on the cluster's workers; pass --redis\n")
        else:
            failed += _run_transfers(transfers, root, redis_url, out)
        return 1 if failed else 0
    from marl.local.launcher import DEFAULT_CORES, Cluster, service_threads

    failed = 0
    for model in dict.fromkeys(c.model for c in matrix.cells):
        cells = [c for c in todo if c.model == model]
        mine = [t for t in transfers if t.model == model]
        if not cells and not mine:
            continue
        specs = [c.spec for c in cells] or [t.spec for t in mine]
        # vLLM's LoRA slots hold every adapter version in flight of the runs served at once
        in_flight = sorted((adapter_versions_in_flight(s) for s in specs), reverse=True)
        started = time.monotonic()
        cluster = Cluster(
            root / "cluster", specs[0].model.path, engine=resolve_engine(specs[0].engine),
            max_lora_rank=max(s.lora.rank for s in specs),
            # Table 3 serves two adapters at once (SA-RL's and the base model's zeros)
            max_loras=max(2, sum(in_flight[:parallel])),
            max_concurrent_runs=parallel if parallel > 1 else None,
            # runs at once generate and train at once: disjoint shares of the cores
            threads=service_threads(DEFAULT_CORES, overlapped=parallel > 1),
        )  # fmt: skip
        endpoints = cluster.start()
        out.write(f"cluster up in {time.monotonic() - started:.0f}s (model {model})\n")
        try:
            url = str(endpoints["redis"])
            failed += _run_cells(cells, root, matrix, endpoints["learner"], url, out, parallel)
            failed += _run_transfers(mine, root, url, out)
        finally:
            cluster.stop()
    return 1 if failed else 0


class _Progress:
    """How one cell's progress is written. One cell at a time, its line grows as it goes
    (`[3/8] cell: run ID .... SUCCEEDED in 40s, peak val 0.5`); cells at once, each writes
    whole lines (its run when submitted, its end), under a lock shared by the cells."""

    def __init__(self, out: TextIO, head: str, lock: threading.Lock | None):
        self.out, self.head, self.lock = out, head, lock

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def begin(self) -> None:
        if self.lock is None:
            self._write(self.head)

    def note(self, text: str) -> None:
        """What the cell is doing (its run); the line goes on with its steps."""
        if self.lock is None:
            self._write(f"{text} ")
        else:
            with self.lock:
                self._write(f"{self.head}{text}\n")

    def step(self) -> None:
        if self.lock is None:
            self._write(".")

    def steps_done(self) -> None:
        if self.lock is None:
            self._write(" ")

    def end(self, text: str) -> None:
        if self.lock is None:
            self._write(f"{text}\n")
        else:
            with self.lock:
                self._write(f"{self.head}{text}\n")


def _run_cells(
    cells: list[Cell], root: Path, matrix: Matrix, learner: str, redis_url: str | None,
    out: TextIO, parallel: int = 1,
) -> int:  # fmt: skip
    """Run `cells`, `parallel` at a time; how many failed."""
    from marl.clients.runs import RunsClient

    if not cells:
        return 0
    lock = None if parallel == 1 else threading.Lock()
    with RunsClient(learner) as runs:

        def one(cell: Cell) -> int:
            head = f"[{matrix.cells.index(cell) + 1}/{len(matrix.cells)}] {cell.name}: "
            return _run_cell(cell, root, runs, redis_url, _Progress(out, head, lock))

        if parallel == 1:
            return sum(one(cell) for cell in cells)
        with ThreadPoolExecutor(parallel, thread_name_prefix="cell") as pool:
            return sum(pool.map(one, cells))


def _run_cell(
    cell: Cell, root: Path, runs: Any, redis_url: str | None, progress: _Progress
) -> int:
    """Run one cell to its end and mark it; 1 if it did not succeed."""
    d = cell_dir(root, cell)
    started = time.monotonic()
    progress.begin()
    adopted = _live_run(runs, d) if cell.kind != BASE_CONTROL else None
    if adopted is None:
        shutil.rmtree(d, ignore_errors=True)  # a half-finished cell starts over
        d.mkdir(parents=True)
    cell.spec.out_dir = str(d.resolve())
    if cell.kind == BASE_CONTROL:
        assert redis_url is not None
        state, info = _run_base(cell, d, redis_url)
    else:
        state, info = _run_training(cell, runs, progress, root, adopted)
    seconds = time.monotonic() - started
    _mark(root, cell, state, seconds=round(seconds, 1), **info)
    rows = read_metrics(d / "metrics.jsonl") if (d / "metrics.jsonl").is_file() else []
    c = curve(rows)
    peak = f", peak val {c.peak:.3f}" if c is not None else ""
    error = f": {info['error']}" if info.get("error") and state != "SUCCEEDED" else ""
    progress.end(f"{state} in {seconds:.0f}s{peak}{error}")
    return 0 if state == "SUCCEEDED" else 1


def _run_base(cell: Cell, d: Path, redis_url: str) -> tuple[str, dict[str, Any]]:
    from marl.experiments.evaluate import AdapterSource, evaluate_sync
    from marl.spec.run import dump_spec

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


def _run_training(
    cell: Cell, runs: Any, progress: _Progress, root: Path, adopted: str | None
) -> tuple[str, dict[str, Any]]:
    run_id = adopted or runs.submit(cell.spec)
    _mark(root, cell, "RUNNING", run_id=run_id)
    progress.note(f"run {run_id}{' (resumed following it)' if adopted else ''}")
    last = -1
    for event in runs.watch(run_id):
        step = event.run.step
        if event.metrics is not None and step != last:
            last = step
            progress.step()
    run = runs.get(run_id)
    progress.steps_done()
    return run.state, {"run_id": run_id, "error": run.error}


def _run_transfers(transfers: list[Transfer], root: Path, redis_url: str, out: TextIO) -> int:
    """Table 3's evaluations whose SA-RL cell is done; 1 per one that failed."""
    from marl.experiments.evaluate import evaluate_sync, generator_transfer, solver_role

    failed = 0
    for t in transfers:
        if not cell_done(root, t.sa_rl):
            out.write(f"table3 {t.name}: skipped, the SA-RL cell {t.sa_rl.name} is not done\n")
            continue
        started = time.monotonic()
        out.write(f"table3 {t.name}: ")
        out.flush()
        sa_dir = cell_dir(root, t.sa_rl)
        routing = generator_transfer(t.spec, sa_dir, "latest")
        metrics = evaluate_sync(t.spec, routing, redis_url)
        seconds = time.monotonic() - started
        if metrics["val/episode_errors"] == metrics["val/problems"]:
            failed += 1
            out.write(f"FAILED: every episode failed: {metrics['val/first_episode_error']}\n")
            continue
        sa = json.loads((sa_dir / "cell.json").read_text())
        role = solver_role(t.spec)
        assert role is not None
        step = routing[role].step
        sa_vals = {
            int(r["step"]): r["val/accuracy"]
            for r in read_metrics(sa_dir / "metrics.jsonl")
            if "val/accuracy" in r
        }
        _write_json(transfer_path(root, t), {
            "task": t.task, "model": t.model, "seed": t.seed, "workflow": t.workflow,
            "role": role, "sa_rl_cell": t.sa_rl.name, "sa_rl_run_id": sa.get("run_id"),
            "checkpoint": f"step_{step:06d}", "sa_rl_final": sa_vals.get(step),
            "routing": {role: s.label for role, s in routing.items()},
            "seconds": round(seconds, 1), **metrics,
        })  # fmt: skip
        out.write(f"val {metrics['val/accuracy']:.3f} in {seconds:.0f}s\n")
        out.flush()
    return failed
