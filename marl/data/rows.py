"""Rows of local parquet / jsonl files, and what happens to the malformed ones.

A data file is read row by row; each row is turned into a `Problem` by a
dataset's converter, which raises `RowError` naming the field that is wrong. A
malformed row is then skipped with a warning or refuses the run, as
`data.on_bad_row` says, and is always reported with its file and row number
(1-based: the line number in a jsonl file, the row index + 1 in a parquet file or a
`datasets` folder's arrow files).

A `datasets` folder (`Dataset.save_to_disk`) is read with pyarrow alone: its
`state.json` lists its arrow files, in order. A DatasetDict folder
(`dataset_dict.json`) gives its `train` split to `data.train_path` and its
validation (or test) split to `data.val_path`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from marl.problem import Problem
from marl.spec.run import SpecError
from marl.spec.safe_input import MAX_DEPTH, check_path, load_json, read_text, shorten, too_deep

log = logging.getLogger(__name__)

SUFFIXES = (".parquet", ".jsonl", ".json", ".arrow")


class RowError(ValueError):
    """A row that is not in the dataset's schema; the message names the field."""


@dataclass(frozen=True)
class Row:
    file: str
    number: int
    data: dict[str, Any] | None
    error: str | None = None
    """Why the row could not even be read (bad JSON); `data` is None then."""


@dataclass(frozen=True)
class BadRow:
    file: str
    number: int
    reason: str

    def __str__(self) -> str:
        return f"{self.file} row {self.number}: {self.reason}"


@dataclass
class Loaded:
    """Everything read from one data source."""

    problems: list[Problem]
    files: list[str]
    rows: int = 0
    bad_rows: list[BadRow] = field(default_factory=list)
    duplicates: int = 0
    """Rows repeating an earlier problem exactly (DAPO-Math-17K ships each one many times)."""
    read_as: str = ""
    """How the rows were read (`marl data inspect`): a schema's name, or the column mapping."""


VAL_SPLITS = ("validation", "valid", "val", "test")
"""A DatasetDict's split read by `data.val_path`: the first of these it has."""


def data_files(path: str, field_name: str) -> list[Path]:
    """The files `path` names: itself, every parquet/jsonl file under a folder, or the
    arrow files of a `datasets` folder (`save_to_disk`)."""
    p = check_path(path, f"field `{field_name}`", SpecError).expanduser()
    if not p.exists():
        raise SpecError(f"field `{field_name}`: {shorten(path)!r} does not exist; point it at a local "
                        ".parquet or .jsonl file, or a folder of them")
    if p.is_dir() and (p / "dataset_dict.json").is_file():
        return _dataset_dict_files(p, field_name)
    if p.is_dir() and (p / "state.json").is_file():
        return _saved_dataset_files(p, field_name)
    if p.is_file():
        if p.suffix not in SUFFIXES:
            raise SpecError(f"field `{field_name}`: {path!r} is not a .parquet or .jsonl file")
        return [p]
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in SUFFIXES)
    if not files:
        raise SpecError(f"field `{field_name}`: folder {path!r} holds no .parquet or .jsonl files")
    return files


def has_val_split(path: str) -> bool:
    """Whether `path` is a DatasetDict folder with a validation (or test) split: it then
    gives validation its own split rather than one held out of `train`."""
    p = Path(path).expanduser()
    if not (p / "dataset_dict.json").is_file():
        return False
    try:
        meta = json.loads((p / "dataset_dict.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and any(s in meta.get("splits", []) for s in VAL_SPLITS)


def _dataset_dict_files(p: Path, field_name: str) -> list[Path]:
    meta = load_json(read_text(p / "dataset_dict.json", str(p), SpecError), str(p), SpecError)
    splits = [str(s) for s in meta.get("splits", [])] if isinstance(meta, dict) else []
    wanted = ("train",) if field_name.endswith("train_path") else VAL_SPLITS
    split = next((s for s in wanted if s in splits), None)
    if split is None:
        raise SpecError(f"field `{field_name}`: the DatasetDict folder {shorten(str(p))!r} has "
                        f"splits {', '.join(splits) or '(none)'}, none of {', '.join(wanted)}; "
                        "point the path at a split's own folder")
    return _saved_dataset_files(p / split, field_name)


def _saved_dataset_files(p: Path, field_name: str) -> list[Path]:
    state = load_json(read_text(p / "state.json", str(p), SpecError), str(p), SpecError)
    names = [f.get("filename") for f in state.get("_data_files", [])] if isinstance(
        state, dict) else []
    files = [p / n for n in names if isinstance(n, str) and "/" not in n and n.endswith(".arrow")]
    if not files or len(files) != len(names) or not all(f.is_file() for f in files):
        raise SpecError(f"field `{field_name}`: {shorten(str(p))!r} is not a complete "
                        "`datasets` folder (state.json must list its .arrow files)")
    return files


def columns_of(path: Path) -> list[str]:
    """The columns of a data file: its schema's (parquet, arrow), or its first row's keys."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return list(pq.ParquetFile(path).schema_arrow.names)
        except (OSError, ValueError) as err:
            raise SpecError(f"{path} is not a readable parquet file: {err}") from None
    if path.suffix == ".arrow":
        with _arrow_reader(path) as reader:
            return list(reader.schema.names)
    first = next((r for r in read_rows(path) if r.data is not None), None)
    return list(first.data) if first is not None and first.data is not None else []


def read_rows(
    path: Path, columns: Iterable[str] | None = None, batch_rows: int = 1024
) -> Iterator[Row]:
    """Every row of one file; `columns` limits what a parquet file decodes, `batch_rows` how
    many rows it decodes at once (DeepCoder rows can hold tens of MB of tests)."""
    if path.suffix == ".parquet":
        yield from _parquet_rows(path, columns, batch_rows)
    elif path.suffix == ".arrow":
        yield from _arrow_rows(path, columns)
    elif path.suffix == ".json":
        yield from _json_array_rows(path)
    else:
        yield from _jsonl_rows(path)


def _parquet_rows(path: Path, columns: Iterable[str] | None, batch_rows: int) -> Iterator[Row]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise SpecError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    try:
        reader = pq.ParquetFile(path)
        present = set(reader.schema_arrow.names)
        wanted = None if columns is None else [c for c in columns if c in present]
        number = 0
        for batch in reader.iter_batches(batch_size=batch_rows, columns=wanted):
            for data in batch.to_pylist():
                number += 1
                yield Row(str(path), number, data)
    except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
        raise SpecError(f"{path} is not a readable parquet file: {err}") from None


def _arrow_reader(path: Path) -> Any:
    """A reader of an arrow file as `datasets` writes it (the IPC stream format; the file
    format too)."""
    import pyarrow as pa

    try:
        return pa.ipc.open_stream(pa.memory_map(str(path)))
    except (OSError, ValueError):
        pass
    try:
        return pa.ipc.open_file(pa.memory_map(str(path)))
    except (OSError, ValueError) as err:
        raise SpecError(f"{path} is not a readable arrow file: {err}") from None


def _arrow_rows(path: Path, columns: Iterable[str] | None) -> Iterator[Row]:
    number = 0
    with _arrow_reader(path) as reader:
        present = set(reader.schema.names)
        wanted = None if columns is None else [c for c in columns if c in present]
        batches = reader if hasattr(reader, "read_next_batch") and not hasattr(
            reader, "num_record_batches") else (
            reader.get_batch(i) for i in range(reader.num_record_batches))
        for batch in batches:
            if wanted is not None:
                batch = batch.select(wanted)
            for data in batch.to_pylist():
                number += 1
                yield Row(str(path), number, data)


def _jsonl_rows(path: Path) -> Iterator[Row]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield Row(str(path), number, None, f"not UTF-8 text (byte {err.start})")
                continue
            if not line.strip():
                continue
            try:
                data = json.loads(line)
                deep = too_deep(data)
            except json.JSONDecodeError as err:
                yield Row(str(path), number, None, f"not valid JSON ({err.msg})")
                continue
            except RecursionError:
                deep = True
            if deep:
                yield Row(str(path), number, None, f"nested more than {MAX_DEPTH} levels deep")
                continue
            if isinstance(data, dict):
                yield Row(str(path), number, data)
            else:
                yield Row(str(path), number, None, "not a JSON object")


def _json_array_rows(path: Path) -> Iterator[Row]:
    data = load_json(read_text(path, str(path), SpecError), str(path), SpecError)
    if not isinstance(data, list):
        raise SpecError(f"{path} must hold a JSON list of rows (or use .jsonl)")
    for number, item in enumerate(data, start=1):
        if isinstance(item, dict):
            yield Row(str(path), number, item)
        else:
            yield Row(str(path), number, None, "not a JSON object")


def convert(
    rows: Iterable[Row],
    to_problem: Callable[..., Problem],
    on_bad_row: Literal["skip", "refuse"],
    files: list[str],
    with_file: bool = False,
) -> Loaded:
    """Problems from rows; malformed rows skipped or refused, exact repeats dropped.
    `with_file`: `to_problem(data, path)` is told the row's file too."""
    loaded = Loaded(problems=[], files=files)
    first_row: dict[str, tuple[Problem, str, int]] = {}
    for row in rows:
        loaded.rows += 1
        try:
            if row.data is None:
                raise RowError(row.error or "unreadable row")
            problem = (to_problem(row.data, Path(row.file)) if with_file
                       else to_problem(row.data))
            seen = first_row.get(problem.id)
            if seen is not None and seen[0] != problem:
                raise RowError(f"id {problem.id!r} repeats row {seen[2]} of {seen[1]} "
                               "with different content")
        except RowError as err:
            bad = BadRow(row.file, row.number, str(err))
            if on_bad_row == "refuse":
                raise SpecError(f"{bad}. Fix the row, or set data.on_bad_row=skip to skip "
                                "malformed rows") from None
            log.warning("skipping malformed row: %s", bad)
            loaded.bad_rows.append(bad)
            continue
        if seen is not None:
            loaded.duplicates += 1
            continue
        first_row[problem.id] = (problem, row.file, row.number)
        loaded.problems.append(problem)
    return loaded


def require_text(data: dict[str, Any], key: str) -> str:
    """`data[key]` as a non-empty string, or a RowError naming the field."""
    value = data.get(key)
    if not isinstance(value, str) or not value.strip():
        raise RowError(f"`{key}` is missing or empty" if value in (None, "")
                       else f"`{key}` must be a string, got {type(value).__name__}")
    return value
