"""The DAPO-Math-17K loader on fixture files in the published schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from marl.data import load_problems, load_split
from marl.data.dapo import INSTRUCTION_HEAD, INSTRUCTION_TAIL, to_problem
from marl.data.rows import RowError
from marl.spec.run import DataSpec, SpecError

FIXTURES = Path(__file__).parents[1] / "fixtures"
PARQUET = FIXTURES / "dapo_math" / "dapo-math-17k.parquet"
JSONL = FIXTURES / "dapo-math-17k.jsonl"
BAD = FIXTURES / "dapo_math_bad.jsonl"


def spec(path: Path | str, **kw: object) -> DataSpec:
    return DataSpec(train="dapo_math", val="champ", train_path=str(path), **kw)  # type: ignore[arg-type]


def test_fixture_has_the_published_columns() -> None:
    import pyarrow.parquet as pq

    schema = pq.read_schema(PARQUET)
    assert schema.names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    message = "list<element: struct<content: string, role: string>>"
    assert str(schema.field("prompt").type) == message
    assert str(schema.field("reward_model").type) == "struct<ground_truth: string, style: string>"
    assert str(schema.field("extra_info").type) == "struct<index: string>"


@pytest.mark.parametrize("path", [PARQUET, JSONL, FIXTURES / "dapo_math"])
def test_reads_parquet_jsonl_and_folders(path: Path) -> None:
    data = load_split(spec(path), "train", seed=0)
    assert len(data.problems) == 8
    assert data.source.rows == 10
    assert data.source.duplicates == 2  # the file repeats two problems, as the real one does
    by_answer = {p.answer for p in data.problems}
    assert by_answer == {"2", "9", "56", "7", "6", "97", "-7"}
    assert all(p.task == "math" and p.id.startswith("dapo-") for p in data.problems)


def test_prompt_is_the_problem_without_the_answer_line_instruction() -> None:
    problems = load_problems(spec(PARQUET), "train", seed=0)
    p = next(p for p in problems if p.answer == "97")
    assert p.prompt == "What is the smallest prime greater than $90$?"
    assert all("Answer:" not in q.prompt for q in problems)


def test_parquet_and_jsonl_give_the_same_problems() -> None:
    a = load_problems(spec(PARQUET), "train", seed=3)
    b = load_problems(spec(JSONL), "train", seed=3)
    assert a == b


def test_row_conversion() -> None:
    row = {
        "data_source": "math_dapo",
        "prompt": [{"content": f"{INSTRUCTION_HEAD}Find $1+1$.{INSTRUCTION_TAIL}", "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "2", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "abc-123"},
    }
    p = to_problem(row)
    assert (p.id, p.prompt, p.answer, p.task, p.tests) == ("dapo-abc-123", "Find $1+1$.", "2",
                                                         "math", [])
    with pytest.raises(RowError, match="reward_model.ground_truth"):
        to_problem({**row, "reward_model": {"style": "x"}})
    with pytest.raises(RowError, match="prompt"):
        to_problem({**row, "prompt": [{"role": "system", "content": "hi"}]})
    no_index = to_problem({**row, "extra_info": None})
    assert no_index.id.startswith("dapo-") and no_index.id != "dapo-abc-123"


def test_malformed_rows_are_skipped_and_reported_with_file_and_row() -> None:
    data = load_split(spec(BAD), "train", seed=0)
    assert [p.answer for p in sorted(data.problems, key=lambda p: p.answer)] == ["2", "7", "97"]
    reported = [(Path(b.file).name, b.number) for b in data.source.bad_rows]
    assert reported == [(BAD.name, 2), (BAD.name, 4), (BAD.name, 5), (BAD.name, 6)]
    assert "reward_model.ground_truth" in data.source.bad_rows[0].reason
    assert "JSON" in data.source.bad_rows[1].reason


def test_malformed_row_refuses_the_run_when_asked() -> None:
    with pytest.raises(SpecError, match=r"dapo_math_bad\.jsonl row 2: .*ground_truth.*on_bad_row"):
        load_problems(spec(BAD, on_bad_row="refuse"), "train", seed=0)


def test_same_id_with_different_content_is_a_bad_row(tmp_path: Path) -> None:
    rows = [json.loads(line) for line in JSONL.read_text().splitlines()[:2]]
    rows[1]["extra_info"] = rows[0]["extra_info"]
    path = tmp_path / "clash.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    data = load_split(spec(path), "train", seed=0)
    assert len(data.problems) == 1
    assert "repeats row 1" in data.source.bad_rows[0].reason


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"train_path": None}, r"field `data.train_path`: dapo_math is read from a local file"),
        ({"train_path": "/no/such/file.parquet"}, r"`data.train_path`: '/no/such/file.parquet' "
                                                  r"does not exist"),
        ({"train_path": str(FIXTURES / "make_fixtures.py")}, "not a .parquet or .jsonl file"),
    ],
)
def test_user_errors_name_the_field(kw: dict[str, object], message: str) -> None:
    data = DataSpec(train="dapo_math", val="champ", **kw)  # type: ignore[arg-type]
    with pytest.raises(SpecError, match=message):
        load_problems(data, "train", seed=0)


def test_a_broken_parquet_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"PAR1 not really")
    with pytest.raises(SpecError, match="broken.parquet is not a readable parquet file"):
        load_problems(spec(path), "train", seed=0)


def test_a_file_with_no_usable_rows_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text('{"prompt": []}\n')
    with pytest.raises(SpecError, match="no usable dapo_math problems"):
        load_problems(spec(path), "train", seed=0)
