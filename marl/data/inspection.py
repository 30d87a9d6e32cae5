"""`marl data inspect SPEC.yaml [key=value ...]`: what a run spec's data looks like.

Prints, for the train and the validation split: where the problems come from,
how many rows were read, skipped as malformed (with file and row) or dropped as
repeats, one sample problem, and the answer formats (math) or test kinds (code).
A user error (a missing file, a bad field, a malformed row under
`data.on_bad_row=refuse`) prints `error: ...` naming it and exits 2.
"""

from __future__ import annotations

import logging
import sys
import textwrap
from collections import Counter
from typing import TextIO

from marl.data import SplitData, load_split
from marl.data.stats import answer_formats, count_tests, kinds_of_tests
from marl.problem import Problem
from marl.spec.run import RunSpec, SpecError, apply_overrides, parse_spec, task_of_dataset

USAGE = "usage: marl data inspect SPEC.yaml [key=value ...]"
SHOWN_BAD_ROWS = 10
PROMPT_CHARS = 600


def _load_spec(argv: list[str]) -> RunSpec:
    from marl.spec.safe_input import check_path, load_yaml, read_text, shorten

    path, overrides = check_path(argv[0], "spec file", SpecError), argv[1:]
    if not path.is_file():
        raise SpecError(f"spec file {shorten(str(path))!r} does not exist")
    data = load_yaml(read_text(path, "spec file", SpecError), shorten(str(path)), SpecError) or {}
    if not isinstance(data, dict):
        raise SpecError(f"{path} must be a mapping of fields, e.g. `workflow: voting`")
    return parse_spec(apply_overrides(data, overrides))


def _counter_line(counts: Counter[str]) -> str:
    total = sum(counts.values()) or 1
    return ", ".join(f"{k} {n} ({100 * n / total:.0f}%)" for k, n in counts.most_common())


def _sample(problem: Problem, out: TextIO) -> None:
    prompt = problem.prompt if len(problem.prompt) <= PROMPT_CHARS else (
        problem.prompt[:PROMPT_CHARS] + " [...]")
    out.write(f"  sample {problem.id}:\n")
    out.write(textwrap.indent(prompt, "    | ", lambda _: True) + "\n")
    if problem.messages is not None:
        out.write(f"    chat prompt: {len(problem.messages)} messages ("
                  f"{', '.join(m['role'] for m in problem.messages)})\n")
    if problem.data_source:
        out.write(f"    data_source: {problem.data_source}\n")
    if problem.extra_info:
        out.write(f"    extra_info: {textwrap.shorten(str(problem.extra_info), 200)}\n")
    if problem.task == "math":
        out.write(f"    answer: {problem.answer}\n")
    else:
        first = problem.tests[0]
        shown = {k: (v if len(str(v)) < 120 else str(v)[:120] + "...") for k, v in first.items()}
        out.write(f"    tests: {len(problem.tests)}, first: {shown}\n")


def _report(which: str, data: SplitData, spec: RunSpec, out: TextIO, show_source: bool) -> None:
    problems = data.problems
    task = task_of_dataset(data.name)
    if problems and data.source.read_as and not data.source.read_as.startswith("the published"):
        task = Counter(p.task for p in problems).most_common(1)[0][0]  # a file's own rows
    name = data.name if not data.source.read_as.startswith(("verl", "columns")) else "file"
    out.write(f"{which}: {name} ({task}), {len(problems)} problems\n")
    if show_source:
        _source(data, spec, out)
    if problems:
        _sample(problems[0], out)
    if task == "math":
        out.write(f"  answer formats: {_counter_line(answer_formats(problems))}\n")
    else:
        low, median, high = count_tests(problems)
        out.write(f"  test kinds: {_counter_line(kinds_of_tests(problems))}\n")
        out.write(f"  tests per problem: min {low}, median {median:g}, max {high}\n")


def _source(data: SplitData, spec: RunSpec, out: TextIO) -> None:
    source = data.source
    out.write(f"  from: {', '.join(source.files)}\n")
    if source.read_as:
        out.write(f"  read as: {source.read_as}\n")
    out.write(f"  rows read {source.rows}, malformed {len(source.bad_rows)} "
              f"({spec.data.on_bad_row}), repeats dropped {source.duplicates}, "
              f"problems in the set {len(source.problems)}\n")
    for bad in source.bad_rows[:SHOWN_BAD_ROWS]:
        out.write(f"    skipped {bad}\n")
    if len(source.bad_rows) > SHOWN_BAD_ROWS:
        out.write(f"    ... and {len(source.bad_rows) - SHOWN_BAD_ROWS} more\n")


def main(argv: list[str]) -> int:
    """Print the data report for a spec; 0 on success, 2 on a user error."""
    if not argv or argv[0] in ("-h", "--help"):
        (sys.stdout if argv else sys.stderr).write(USAGE + "\n")
        return 0 if argv else 2
    try:
        return run(argv)
    except SpecError as err:
        sys.stderr.write(f"error: {err}\n")
        return 2


def run(argv: list[str]) -> int:
    """The report for `SPEC.yaml [key=value ...]`; a bad spec or file raises SpecError."""
    logging.getLogger("marl.data.rows").setLevel(logging.ERROR)  # the report lists skipped rows
    spec = _load_spec(argv)
    splits = [(which, load_split(spec.data, which, spec.seed)) for which in ("train", "val")]
    same = spec.data.train == spec.data.val and spec.data.val_path in (None, spec.data.train_path)
    if same:
        how = ("its fixed split" if spec.data.train == "arithmetic"
               else f"val_fraction {spec.data.val_fraction}")
        sys.stdout.write(f"train and val split one set ({how}, seed {spec.seed})\n")
    for which, data in splits:
        _report(which, data, spec, sys.stdout, show_source=which == "train" or not same)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
