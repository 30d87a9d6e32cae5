"""What a run spec from the network may name on this learner: code, paths, judge endpoints.

A spec arrives from whoever can reach the Runs API; the learner's operator decides what it
may touch through the learner's config (marl/spec/services.py, `LearnerConfig`):

- code: `workflow` and `reward.function` only from marl's built-ins, installed entry
  points or `allowed_modules` (marl/spec/code_refs.py); checked before anything is
  imported;
- paths: `out_dir` under `runs_dir` or an `out_dir_roots` entry, and never a run's
  directory (nor inside one); `model.path` under `model_roots` or a model name;
  `data.*_path` under `data_roots`. Paths are compared after symlinks are resolved, so a
  link inside a root that points out of it is refused too;
- `reward.judge.endpoint` only one of `judge_endpoints` (the workers send the judge's
  key there);
- the spec's size, `max_spec_bytes`, before it is parsed.

Each refusal is a SpecError naming the field and the setting that would allow it.
"""

from __future__ import annotations

import os
from pathlib import Path

from marl.models import names as model_names
from marl.rewards import functions as reward_functions
from marl.rewards.spec_checks import check_judge_endpoint
from marl.spec.code_refs import CodePolicy
from marl.spec.run import RunSpec, SpecError
from marl.spec.safe_input import shorten
from marl.spec.services import LearnerConfig, env_name
from marl.workflows import registry

RUN_MARKERS = ("run.yaml", "metrics.jsonl", "checkpoints/latest")
"""What a run writes into its directory first: a directory holding one is a run's."""


def setting(field: str) -> str:
    """How a refusal names a learner setting: `the learner's FIELD (MARL_LEARNER_FIELD)`."""
    return f"the learner's {field} ({env_name('learner', field)})"


def code_policy(cfg: LearnerConfig) -> CodePolicy:
    return CodePolicy(tuple(cfg.allowed_modules), setting("allowed_modules"))


def check_size(spec_yaml: str, cfg: LearnerConfig) -> None:
    size = len(spec_yaml.encode("utf-8", errors="replace"))
    if size > cfg.max_spec_bytes:
        raise SpecError(
            f"the spec is {size} bytes; this learner takes at most {cfg.max_spec_bytes} "
            f"({setting('max_spec_bytes')}): move data into data files"
        )


def check_code(spec: RunSpec, policy: CodePolicy) -> None:
    """`workflow` and `reward.function` are names `policy` allows (nothing is imported)."""
    registry.check(spec.workflow, policy)
    if spec.reward.function is not None:
        reward_functions.check_name(spec.reward.function, policy)


def check_judge(spec: RunSpec, cfg: LearnerConfig) -> None:
    judge = spec.reward.judge
    if judge is not None and judge.endpoint is not None:
        check_judge_endpoint(judge.endpoint, cfg.judge_endpoints, setting("judge_endpoints"))


def real(path: str | Path) -> Path:
    """`path` absolute, `~` expanded and every symlink resolved (as far as it exists)."""
    return Path(os.path.realpath(Path(path).expanduser()))


def under(path: Path, roots: list[Path]) -> bool:
    return any(path == root or path.is_relative_to(root) for root in roots)


def check_model_and_data(spec: RunSpec, cfg: LearnerConfig) -> None:
    """`model.path` is a model name or lies under `model_roots`; data paths under
    `data_roots`."""
    path = spec.model.path
    if not (path in model_names.NAMES and not Path(path).is_dir()):
        roots = [real(r) for r in cfg.model_roots]
        if not under(real(path), roots):
            raise SpecError(
                f"field `model.path`: {shorten(path)} is not under this learner's model "
                f"directories ({', '.join(map(str, roots)) or 'none'}); name a model "
                f"({', '.join(model_names.NAMES)}) or a directory under "
                f"{setting('model_roots')}"
            )
    for field in ("train_path", "val_path"):
        value = getattr(spec.data, field)
        if value is None:
            continue
        roots = [real(r) for r in cfg.data_roots]
        if not under(real(value), roots):
            raise SpecError(
                f"field `data.{field}`: {shorten(value)} is not under this learner's data "
                f"directories ({', '.join(map(str, roots)) or 'none'}); use a bundled data "
                f"set or a file under {setting('data_roots')}"
            )


def check_out_dir(out_dir: str, runs_dir: Path, cfg: LearnerConfig) -> Path:
    """The spec's `out_dir`, resolved, if it lies under `runs_dir` or an `out_dir_roots`
    entry and is no run's directory (nor inside one) on disk. (A run without one writes to
    `<runs_dir>/<run id>`; another run that claimed a directory but has not written yet is
    `RunStore.claim_out_dir`'s to refuse.)"""
    path = real(out_dir)
    roots = [real(runs_dir), *(real(r) for r in cfg.out_dir_roots)]
    if not under(path, roots):
        raise SpecError(
            f"field `out_dir`: {shorten(out_dir)} is not under this learner's runs "
            f"directories ({', '.join(map(str, roots))}); leave out_dir unset (the run "
            f"writes to <runs_dir>/<run id>), or ask for a root in {setting('out_dir_roots')}"
        )
    for folder in (path, *path.parents):
        if not under(folder, roots):
            break
        if any((folder / marker).exists() for marker in RUN_MARKERS):
            where = "is" if folder == path else f"is inside {shorten(str(folder))}, which is"
            raise SpecError(
                f"field `out_dir`: {shorten(out_dir)} {where} another run's directory; "
                "name a new directory (or leave out_dir unset)"
            )
    return path
