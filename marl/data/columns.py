"""Rows of any data file as problems: verl's preprocessed schema, or plain columns mapped.

verl's schema (what its `examples/data_preprocess/*.py` write), read unchanged:
  data_source   string                       passed to the reward function
  prompt        list<struct<role, content>>  the chat prompt
  ability       string                       "math", "code", ...
  reward_model  struct<style, ground_truth>  the ground truth (any JSON value)
  extra_info    struct                       `index` names the problem; passed on

Plain columns: `data.prompt_key` (a string, or chat messages), `data.answer_key`
(the ground truth), `data.tests_key` (a code problem's tests); a dotted key reads
a nested field. Unset keys take the first common name the file has (`prompt`,
`question`, `problem`; `answer`, `ground_truth`; `tests`). A row with tests is a
code problem (its tests in any DeepCoder layout or marl's own), otherwise a math
problem. The row's other columns go to `problem.extra_info`, where a reward
function finds them.

A mapped column that the file does not have at all refuses the file (the mapping
is wrong, not the row), naming the file, its first row and the column; a row whose
value is missing or of the wrong type is a bad row (`data.on_bad_row`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from marl.data.deepcoder import convert_tests
from marl.data.rows import RowError
from marl.problem import Problem
from marl.spec.run import DataSpec, SpecError

PROMPT_NAMES = ("prompt", "question", "problem")
ANSWER_NAMES = ("answer", "ground_truth")
TESTS_NAMES = ("tests",)
VERL_ANSWER = "reward_model.ground_truth"
MISSING = object()


@dataclass(frozen=True)
class Mapping:
    """Which column holds what, for one source."""

    kind: Literal["verl", "columns"]
    prompt: str
    answer: str | None
    tests: str | None

    def describe(self) -> str:
        parts = [f"prompt <- {self.prompt}"]
        if self.answer:
            parts.append(f"answer <- {self.answer}")
        if self.tests:
            parts.append(f"tests <- {self.tests}")
        return f"{self.kind} ({', '.join(parts)})"


def looks_verl(columns: list[str]) -> bool:
    return "prompt" in columns and "reward_model" in columns


def mapping_for(spec: DataSpec, columns: list[str], file: str) -> Mapping:
    """The mapping of a source whose first file has `columns`; a SpecError naming the
    file, row 1 and the column when a mapped column is not there."""
    explicit = any(k is not None for k in (spec.prompt_key, spec.answer_key, spec.tests_key))
    if spec.format == "verl" or (not explicit and looks_verl(columns)):
        for needed in ("prompt", "reward_model"):
            if needed not in columns:
                raise SpecError(_no_column(file, needed, columns, "data.format: verl"))
        return Mapping("verl", spec.prompt_key or "prompt", spec.answer_key or VERL_ANSWER,
                       spec.tests_key)
    prompt = spec.prompt_key or next((c for c in PROMPT_NAMES if c in columns), None)
    if prompt is None:
        raise SpecError(_no_column(file, "/".join(PROMPT_NAMES), columns, "data.prompt_key"))
    answer = spec.answer_key or next((c for c in ANSWER_NAMES if c in columns), None)
    tests = spec.tests_key or next((c for c in TESTS_NAMES if c in columns), None)
    mapped: list[tuple[str | None, str]] = [
        (prompt, "data.prompt_key"), (spec.answer_key, "data.answer_key"),
        (spec.tests_key, "data.tests_key")]
    for key, field in mapped:
        if key is not None and key.split(".")[0] not in columns:
            raise SpecError(_no_column(file, key, columns, field))
    if answer is None and tests is None:
        raise SpecError(_no_column(file, "/".join(ANSWER_NAMES + TESTS_NAMES), columns,
                                   "data.answer_key or data.tests_key"))
    return Mapping("columns", prompt, answer, tests)


def _no_column(file: str, key: str, columns: list[str], field: str) -> str:
    shown = ", ".join(columns[:20]) + (" ..." if len(columns) > 20 else "")
    return (f"{file} row 1: no column `{key}` (its columns: {shown or 'none'}); set {field} "
            "to the column that holds it")


def _get(row: dict[str, Any], key: str) -> Any:
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return MISSING
        value = value[part]
    return value


def _prompt(value: Any, key: str) -> tuple[str, list[dict[str, str]] | None]:
    """(the problem text, the chat messages if the prompt was messages)."""
    if isinstance(value, str):
        if not value.strip():
            raise RowError(f"`{key}` is empty")
        return value, None
    if isinstance(value, list) and value:
        messages = []
        for i, m in enumerate(value):
            if (not isinstance(m, dict) or not isinstance(m.get("role"), str)
                    or not isinstance(m.get("content"), str)):
                raise RowError(f"`{key}`[{i}] must be a {{role, content}} message with text "
                               "content")
            messages.append({"role": m["role"], "content": m["content"]})
        users = [m["content"] for m in messages if m["role"] == "user"]
        if not users or not users[-1].strip():
            raise RowError(f"`{key}` has no user message with text")
        return users[-1], messages
    if value is MISSING or value is None:
        raise RowError(f"`{key}` is missing")
    raise RowError(f"`{key}` must be a string or a list of chat messages, got "
                   f"{type(value).__name__}")


def _answer(value: Any, key: str) -> str | None:
    if value is MISSING or value is None:
        return None
    if isinstance(value, bool):
        raise RowError(f"`{key}` must be a string or a number, got bool")
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, str):
        return value.strip() or None
    return json.dumps(value, sort_keys=True, default=str)  # verl's structured ground truths


def _tests(value: Any, key: str) -> list[dict[str, Any]] | None:
    if value is MISSING or value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise RowError(f"`{key}` is not valid JSON ({err.msg})") from None
    if isinstance(value, list) and value and all(
            isinstance(t, dict) and ({"stdin", "fn_name", "assert_program"} & set(t))
            for t in value):
        return [dict(t) for t in value]
    try:
        return convert_tests(value, None, "")
    except RowError as err:
        raise RowError(f"`{key}`: {err}") from None


def _plain(value: Any) -> Any:
    """A JSON-safe copy (arrow and parquet give dates, bytes and the like)."""
    return json.loads(json.dumps(value, default=str))


def to_problem(row: dict[str, Any], mapping: Mapping, prefix: str) -> Problem:
    text, messages = _prompt(_get(row, mapping.prompt), mapping.prompt)
    answer = None if mapping.answer is None else _answer(_get(row, mapping.answer), mapping.answer)
    tests = None if mapping.tests is None else _tests(_get(row, mapping.tests), mapping.tests)
    if answer is None and not tests:
        missing = mapping.answer or mapping.tests
        raise RowError(f"`{missing}` is missing or empty")
    if mapping.kind == "verl":
        extra = row.get("extra_info")
        extra_info = _plain(extra) if isinstance(extra, dict) else {}
        source = row.get("data_source")
        data_source = source if isinstance(source, str) else ""
        index = extra_info.get("index")
    else:
        used = {mapping.prompt.split(".")[0], *(k.split(".")[0] for k in (mapping.answer,
                                                                         mapping.tests) if k)}
        extra_info = _plain({k: v for k, v in row.items() if k not in used})
        data_source = ""
        index = row.get("id")
    if index is None or str(index) == "" or isinstance(index, dict | list):
        index = hashlib.sha1(text.encode()).hexdigest()[:16]
    source = data_source or prefix
    return Problem(
        id=f"{source}-{index}",
        prompt=text,
        answer=answer or "",
        task="code" if tests else "math",
        tests=tests or [],
        messages=messages,
        data_source=data_source,
        extra_info=extra_info,
    )


def source_prefix(path: Path) -> str:
    """Ids of a plain-columns file's problems start with the file's name (a `datasets`
    folder's), so rows of two files with the same `id` are not taken for one problem."""
    return path.parent.name if path.suffix == ".arrow" else path.stem
