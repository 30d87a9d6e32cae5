"""Datasets a RunSpec can name as `data.train` / `data.val`.

Bundled, nothing to download: `arithmetic` (the demo's synthetic task), `champ`
(270 competition math problems), `humaneval` (164 Python problems). Read from
local parquet/jsonl files in their published schemas: `dapo_math`
(DAPO-Math-17K) and `deepcoder` (DeepCoder-Preview-Dataset). Any other file is read
as verl's preprocessed schema or as plain columns (`data.format`, `data.prompt_key`,
marl/data/columns.py): a path and a format are enough, whatever `data.train` names.

When `data.train` and `data.val` name the same set (and `data.val_path` is unset
or the same file), the set is split deterministically from the seed, holding out
`data.val_fraction` for validation; `arithmetic` keeps its own fixed split.
Otherwise each split is the whole of its set. Either way the problems come in a
deterministic order from the seed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from marl.data import arithmetic, champ, columns, dapo, deepcoder, humaneval
from marl.data.rows import Loaded, columns_of, convert, data_files, has_val_split, read_rows
from marl.data.split import kept, ordered, split
from marl.problem import Problem
from marl.spec.run import DataSpec, SpecError

Split = Literal["train", "val"]
BUNDLED = ("arithmetic", "champ", "humaneval")
FROM_FILE = ("dapo_math", "deepcoder")


@dataclass
class SplitData:
    """One split's problems and what was read to get them (for `marl data inspect`)."""

    name: str
    problems: list[Problem]
    source: Loaded


def load_problems(spec: DataSpec, split: Split, seed: int) -> list[Problem]:
    """The problems of one split, in a deterministic order from `seed`."""
    return load_split(spec, split, seed).problems


def load_split(spec: DataSpec, which: Split, seed: int) -> SplitData:
    name = spec.train if which == "train" else spec.val
    if spec.train == spec.val and spec.val_path in (None, spec.train_path) and not (
            spec.train_path and has_val_split(spec.train_path)):
        if name == "arithmetic" and spec.train_path is None:
            train, val = arithmetic.split(seed)
            source = Loaded(train + val, files=["(bundled arithmetic)"], rows=len(train + val))
        else:
            source = load_set(name, spec.train_path, "data.train_path", spec)
            train, val = split(source.problems, seed, spec.val_fraction, name, spec.val_size,
                               val_source(spec))
        return SplitData(name, train if which == "train" else val, source)
    path, field = (spec.train_path, "data.train_path") if which == "train" else (
        spec.val_path, "data.val_path")
    if which == "val" and path is None and name == spec.train and spec.train_path and (
            has_val_split(spec.train_path)):
        path = spec.train_path  # a DatasetDict's own validation split
    source = load_set(name, path, field, spec)
    if which == "val":
        return SplitData(name, kept(source.problems, seed, spec.val_size, val_source(spec)),
                         source)
    return SplitData(name, ordered(source.problems, seed), source)


def val_source(spec: DataSpec) -> str | None:
    """The `data_source` validation problems must have (`data.val_subset`), or None."""
    return None if spec.val_subset is None else f"deepcoder_{spec.val_subset}"


def load_set(name: str, path: str | None, field: str, spec: DataSpec) -> Loaded:
    """Every problem of the set `name` (bundled, or read from `path`)."""
    if name in BUNDLED:
        if path is not None:
            raise SpecError(f"field `{field}`: {name} is bundled and reads no file; remove "
                            f"{field}, or name a set read from a file (dapo_math, deepcoder)")
        problems = _bundled(name)
        return Loaded(problems, files=[f"(bundled {name})"], rows=len(problems))
    if name not in FROM_FILE:
        raise SpecError(f"unknown dataset {name!r}; choose one of {', '.join(BUNDLED + FROM_FILE)}")
    if path is None:
        raise SpecError(f"field `{field}`: {name} is read from a local file; set {field} to a "
                        f".parquet or .jsonl file (or a folder of them) in the published "
                        f"{name} schema")
    files = data_files(path, field)
    stamp = tuple((str(f), str(f.resolve()), f.stat().st_mtime_ns, f.stat().st_size)
                  for f in files)
    reader = reader_of(name, spec, files)
    loaded = _read_files(reader, stamp, spec.on_bad_row, spec.max_tests)
    if not loaded.problems:
        first = f"; the first: {loaded.bad_rows[0]}" if loaded.bad_rows else ""
        raise SpecError(f"field `{field}`: {path!r} holds no usable {_describe(reader)} "
                        f"problems ({loaded.rows} rows, {len(loaded.bad_rows)} "
                        f"malformed{first})")
    return loaded


Reader = tuple[str, columns.Mapping | None]
"""How a source's rows are read: a published set's schema by name ("dapo_math",
"deepcoder"), or verl's / plain columns ("columns", its mapping)."""


def reader_of(name: str, spec: DataSpec, files: list[Path]) -> Reader:
    """`data.format` and the column keys, applied to the source's first file."""
    cols = columns_of(files[0])
    if not cols:
        raise SpecError(f"{files[0]} row 1: the file holds no rows (it is empty); point "
                        "the path at a file with problems")
    explicit = any(k is not None for k in (spec.prompt_key, spec.answer_key, spec.tests_key))
    if spec.format == "auto" and not explicit:
        if name == "dapo_math" and columns.looks_verl(cols):
            return "dapo_math", None
        if name == "deepcoder" and {"problem", "tests"} <= set(cols):
            return "deepcoder", None
        try:
            return "columns", columns.mapping_for(spec, cols, str(files[0]))
        except SpecError:  # no other shape fits either: the named set's errors say more
            return name, None
    return "columns", columns.mapping_for(spec, cols, str(files[0]))


def _describe(reader: Reader) -> str:
    kind, mapping = reader
    return kind if mapping is None else mapping.describe()


def _bundled(name: str) -> list[Problem]:
    if name == "arithmetic":
        train, val = arithmetic.split(0)
        return train + val
    return champ.load() if name == "champ" else humaneval.load()


@functools.lru_cache(maxsize=4)
def _read_files(
    reader: Reader,
    stamp: tuple[tuple[str, str, int, int], ...],
    on_bad_row: Literal["skip", "refuse"],
    max_tests: int | None,
) -> Loaded:
    """Read once per process while the files are unchanged (train and val share a file)."""
    paths = [Path(given) for given, *_ in stamp]
    name, mapping = reader
    if mapping is not None:
        rows = (row for p in paths for row in read_rows(p))
        loaded = convert(
            rows,
            lambda data, file: columns.to_problem(data, mapping, columns.source_prefix(file)),
            on_bad_row, [str(p) for p in paths], with_file=True,
        )
        loaded.read_as = mapping.describe()
        return loaded
    if name == "dapo_math":
        rows = (row for p in paths for row in read_rows(p, dapo.COLUMNS))
        loaded = convert(rows, dapo.to_problem, on_bad_row, [str(p) for p in paths])
    else:
        rows = (row for p in paths for row in read_rows(p, deepcoder.COLUMNS, batch_rows=32))
        loaded = convert(rows, functools.partial(deepcoder.to_problem, max_tests=max_tests),
                         on_bad_row, [str(p) for p in paths])
    loaded.read_as = f"the published {name} schema"
    return loaded


__all__ = ["BUNDLED", "FROM_FILE", "SplitData", "load_problems", "load_split"]
