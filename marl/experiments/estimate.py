"""What a matrix cell will cost before it runs: `marl matrix FILE --dry-run`.

A rough GPU-hour estimate from the cell's spec alone, for planning a matrix (which cells
fit a budget, which scale dominates it), not a measurement. It counts the tokens a cell
generates and trains and divides them by throughputs derived from the model's size:

- turns per episode: the workflow's most (Single 1, Voting candidates + 1, Orch-Workers
  workers + 2, Eval-Opt 2 × rounds + 1: every revision round used), each response at
  `RESPONSE_FILL` of its cap;
- trained tokens: `TRAINED_PER_GENERATED` per generated token (each turn's prompt is
  trained with it, and later turns' prompts carry earlier responses);
- generation at `GENERATE_MFU` and training at `TRAIN_MFU` of one GPU's `PEAK_FLOPS`, with
  2·N FLOPs a generated token and 8·N a trained one (forward, backward, and the forward
  activation checkpointing recomputes) for N parameters;
- validation: `train.val_problems` episodes at step 0, every `train.val_interval` steps
  and at the end, generated only.

A cell whose model size cannot be read (no `config.json` at `model.path` and no size in its
name, as `Qwen3-1.7B`) or whose workflow is not built in gets no estimate.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from marl.spec.run import RunSpec, response_cap, task_of_dataset

if TYPE_CHECKING:
    from marl.experiments.matrix import Matrix

RESPONSE_FILL = 0.5
"""A response's mean length as a share of its cap (assumed)."""
TRAINED_PER_GENERATED = 2.0
"""Tokens the learner forwards and back-propagates per generated token (assumed)."""
PEAK_FLOPS = 989e12
"""One H100's dense bf16 peak."""
TRAIN_MFU = 0.058
"""The learner's share of that peak, from `bench/learner.py`'s Qwen3-0.6B-shaped LoRA rank 64
run on one H100 (its snapshot on docs/benchmarks.md)."""
GENERATE_MFU = 0.05
"""vLLM's share of that peak when decoding large batches (assumed; not measured here)."""

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([bm])(?![a-z])", re.IGNORECASE)


def parameters(spec: RunSpec, name: str = "") -> float | None:
    """The model's parameter count: from `config.json` at `model.path` where it is on this
    machine, else from a size in the path or `name` (`Qwen3-1.7B`, `qwen3-0.6b`)."""
    config = Path(spec.model.path) / "config.json"
    if config.is_file():
        c = json.loads(config.read_text())
        try:
            h, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
            ffn = c.get("intermediate_size", 4 * h)
        except KeyError:
            return None
        return float(layers * (4 * h * h + 3 * h * ffn) + vocab * h)
    for text in (Path(spec.model.path).name, name):
        m = _SIZE.search(text)
        if m:
            return float(m[1]) * (1e9 if m[2].lower() == "b" else 1e6)
    return None


def turns_per_episode(spec: RunSpec) -> int | None:
    """The most role turns one episode of a built-in workflow takes; None for others."""
    caps = spec.caps
    task = task_of_dataset(spec.data.train)
    rounds = caps.eval_opt_rounds_code if task == "code" else caps.eval_opt_rounds_math
    return {
        "single": 1,
        "voting": caps.voting_candidates + 1,
        "orch_workers": caps.orch_workers + 2,
        "eval_opt": 2 * rounds + 1,
    }.get(spec.workflow)


def val_count(spec: RunSpec) -> int:
    """Validation problems an evaluation reads, as far as the spec says (`train.val_problems`,
    at most `data.val_size`); a smaller validation set caps it further when the run loads it."""
    size = spec.data.val_size
    return spec.train.val_problems if size is None else min(size, spec.train.val_problems)


def validations(spec: RunSpec) -> int:
    """Validations a run makes: step 0, every `val_interval` steps, and the last step."""
    t = spec.train
    return 1 + t.steps // t.val_interval + (t.steps % t.val_interval != 0)


def gpu_hours(spec: RunSpec, *, trains: bool = True, name: str = "") -> float | None:
    """The estimate for one cell (`trains` False: an evaluation-only control, one
    validation); None when the model size or the workflow's turns are unknown."""
    n, turns = parameters(spec, name), turns_per_episode(spec)
    if n is None or turns is None:
        return None
    per_episode = turns * RESPONSE_FILL * response_cap(spec)
    generate_s = 2 * n / (GENERATE_MFU * PEAK_FLOPS)
    train_s = 8 * n / (TRAIN_MFU * PEAK_FLOPS)
    val_tokens = val_count(spec) * per_episode
    seconds = (validations(spec) if trains else 1) * val_tokens * generate_s
    if trains:
        step_tokens = spec.train.problems_per_step * spec.grpo.group_size * per_episode
        seconds += spec.train.steps * step_tokens * (
            generate_s + TRAINED_PER_GENERATED * train_s)
    return seconds / 3600


def shown(hours: float | None) -> str:
    """An estimate as the dry run prints it."""
    if hours is None:
        return "?"
    return "<0.01" if hours < 0.01 else f"{hours:.2f}" if hours < 10 else f"{hours:.0f}"


PLAN_COLUMNS = (
    "cell", "kind", "task", "model", "workflow", "policy", "steps", "batch", "resp_cap",
    "prompt_cap", "val", "val_decoding", "thinking", "gpu_h",
)  # fmt: skip


def thinking(spec: RunSpec) -> str:
    """`model.chat_template_kwargs.enable_thinking` as set, or `template` (left to the
    chat template: Qwen3's thinks)."""
    value = spec.model.chat_template_kwargs.get("enable_thinking")
    return "template" if value is None else ("on" if value else "off")


def plan_rows(matrix: Matrix) -> list[dict[str, str]]:
    """One row per cell (and per Table 3 evaluation) of `matrix`, with its key settings and
    its estimate."""
    from marl.experiments.matrix_tables import BASE_CONTROL, val_decoding
    from marl.workflows import resolve

    rows = []
    for cell in matrix.cells:
        s = cell.spec
        task = task_of_dataset(s.data.train)
        trains = cell.kind != BASE_CONTROL
        rows.append({
            "cell": cell.name, "kind": cell.kind, "task": cell.task, "model": cell.model,
            "workflow": cell.workflow, "policy": cell.policy if trains else "-",
            "steps": str(s.train.steps) if trains else "0",
            "batch": f"{s.train.problems_per_step}x{s.grpo.group_size}" if trains else "-",
            "resp_cap": str(response_cap(s)),
            "prompt_cap": str(resolve(s.workflow).caps_for(s.caps, task).prompt_tokens),
            "val": f"{val_count(s)}/{s.train.val_interval}",
            "val_decoding": val_decoding(cell), "thinking": thinking(s),
            "gpu_h": shown(gpu_hours(s, trains=trains, name=cell.model)),
        })  # fmt: skip
    for t in matrix.transfers:
        s = t.spec
        rows.append({
            "cell": f"transfer {t.name}", "kind": "table3", "task": t.task, "model": t.model,
            "workflow": t.workflow, "policy": "sa_rl", "steps": "0", "batch": "-",
            "resp_cap": str(response_cap(s)), "prompt_cap": "", "val": str(val_count(s)),
            "val_decoding": "", "thinking": thinking(s),
            "gpu_h": shown(gpu_hours(s, trains=False, name=t.model)),
        })  # fmt: skip
    return rows


def plan_lines(matrix: Matrix) -> list[str]:
    """`marl matrix FILE --dry-run`: every cell as a table, the counts and the total."""
    rows = plan_rows(matrix)
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in PLAN_COLUMNS}
    lines = ["  ".join(c.ljust(widths[c]) for c in PLAN_COLUMNS).rstrip()]
    lines += ["  ".join(r[c].ljust(widths[c]) for c in PLAN_COLUMNS).rstrip() for r in rows]
    known = [gpu_hours(c.spec, trains=c.kind != "base", name=c.model) for c in matrix.cells]
    known += [gpu_hours(t.spec, trains=False, name=t.model) for t in matrix.transfers]
    total = sum(h for h in known if h is not None)
    kinds = [c.kind for c in matrix.cells]
    lines += [
        "",
        f"{matrix.name}: {kinds.count('run')} trained cells, {kinds.count('base')} base-model "
        f"and {kinds.count('sa_rl')} single-agent RL controls, {len(matrix.transfers)} Table 3 "
        f"evaluations; nothing was run.",
        f"estimated GPU hours: {shown(total)}"
        + (f" ({known.count(None)} rows unknown)" if None in known else "")
        + f" (H100-class GPU; responses at {RESPONSE_FILL:.0%} of their cap, the workflow's "
        "most turns; marl/experiments/estimate.py says how it is counted)",
        "val: validation problems / interval in steps; batch: problems x group size a step.",
    ]
    return lines
