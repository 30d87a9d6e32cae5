"""Bring-your-own data: verl's parquet unchanged, any JSONL with a column mapping,
`datasets` folders, and bad files refused naming the file, the row and the column."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from marl.data import load_problems, load_split
from marl.data.inspection import main as inspect_main
from marl.spec.run import DataSpec, SpecError

VERL_ROWS = [
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": f"What is {a} + {a}? Answer in \\boxed{{}}."}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(2 * a)},
        "extra_info": {"split": "train", "index": a},
    }
    for a in range(1, 11)
]


def write_verl_parquet(path: Path, rows: list[dict] = VERL_ROWS) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_verl_parquet_loads_unchanged(tmp_path: Path) -> None:
    path = write_verl_parquet(tmp_path / "train.parquet")
    spec = DataSpec(train_path=str(path), format="verl", val_fraction=0.2)
    problems = load_problems(spec, "train", 0) + load_problems(spec, "val", 0)
    assert len(problems) == 10
    p = next(p for p in problems if p.id == "openai/gsm8k-3")
    assert p.prompt == "What is 3 + 3? Answer in \\boxed{}."
    assert p.messages == VERL_ROWS[2]["prompt"]
    assert (p.answer, p.task, p.data_source) == ("6", "math", "openai/gsm8k")
    assert p.extra_info == {"split": "train", "index": 3}
    # format auto finds the same from the file's columns
    auto = DataSpec(train_path=str(path), train="deepcoder", val="deepcoder", val_fraction=0.2)
    assert sorted(x.id for x in load_problems(auto, "train", 0)) == sorted(
        x.id for x in load_problems(spec, "train", 0))


def test_jsonl_with_other_column_names_maps(tmp_path: Path) -> None:
    rows = [{"q": f"What is {a} + 1?", "a": a + 1, "level": "easy"} for a in range(5)]
    path = write_jsonl(tmp_path / "mine.jsonl", rows)
    spec = DataSpec(train_path=str(path), prompt_key="q", answer_key="a", val_fraction=0.2)
    problems = load_problems(spec, "train", 0) + load_problems(spec, "val", 0)
    by_prompt = {p.prompt: p for p in problems}
    assert by_prompt["What is 2 + 1?"].answer == "3"
    assert by_prompt["What is 2 + 1?"].extra_info == {"level": "easy"}
    assert by_prompt["What is 2 + 1?"].messages is None
    # the common names need no mapping; a row with tests is a code problem
    code = [{"question": "Print the sum.", "tests": [{"stdin": "1 2", "expected_stdout": "3"}]},
            {"question": "Echo.", "tests": json.dumps({"inputs": ["a"], "outputs": ["a"]})}]
    path = write_jsonl(tmp_path / "code.jsonl", code)
    problems = load_problems(DataSpec(train_path=str(path), val_fraction=0.4), "train", 0)
    assert problems[0].task == "code" and problems[0].tests


@pytest.mark.parametrize("dict_folder", [False, True])
def test_save_to_disk_folder_loads(tmp_path: Path, dict_folder: bool) -> None:
    datasets = pytest.importorskip("datasets")
    rows = [{"question": f"What is {a} + {a}?", "answer": str(2 * a)} for a in range(8)]
    ds = datasets.Dataset.from_list(rows)
    folder = tmp_path / "ds"
    if dict_folder:
        datasets.DatasetDict({"train": ds, "test": ds.select(range(2))}).save_to_disk(folder)
        spec = DataSpec(train_path=str(folder), val_path=str(folder))
        assert len(load_problems(spec, "train", 0)) == 8
        assert len(load_problems(spec, "val", 0)) == 2
    else:
        ds.save_to_disk(folder)
        spec = DataSpec(train_path=str(folder), val_fraction=0.25)
        assert len(load_problems(spec, "train", 0)) == 6
        assert {p.answer for p in load_problems(spec, "val", 0)} <= {r["answer"] for r in rows}


@pytest.mark.parametrize(
    ("rows", "keys", "message"),
    [
        # a mapped column the file does not have: the mapping is wrong, whatever on_bad_row
        ([{"q": "x", "a": "1"}], {"prompt_key": "question", "answer_key": "a"},
         "bad.jsonl row 1: no column `question` (its columns: q, a); set data.prompt_key"),
        ([{"prompt": "x", "answer": "1"}], {"answer_key": "solution"},
         "bad.jsonl row 1: no column `solution`"),
        # a value of the wrong type, in row 2
        ([{"prompt": "x", "answer": "1"}, {"prompt": 7, "answer": "2"}], {},
         "bad.jsonl row 2: `prompt` must be a string or a list of chat messages, got int"),
        ([{"prompt": "x", "answer": "1"}, {"prompt": "y", "answer": None}], {},
         "bad.jsonl row 2: `answer` is missing or empty"),
        ([{"prompt": "x", "answer": "1"}, {"prompt": [{"role": "user"}], "answer": "2"}], {},
         "bad.jsonl row 2: `prompt`[0] must be a {role, content} message"),
        # an empty file
        ([], {}, "bad.jsonl row 1: the file holds no rows"),
    ],
)
def test_bad_files_name_file_row_and_column(
    tmp_path: Path, rows: list[dict], keys: dict, message: str
) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    spec = DataSpec(train_path=str(path), on_bad_row="refuse", **keys)
    with pytest.raises(SpecError) as err:
        load_problems(spec, "train", 0)
    assert message in str(err.value)


def test_skipped_rows_are_named_when_none_is_left(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": 1, "answer": "1"}] * 3)
    with pytest.raises(SpecError, match=r"the first: .*bad.jsonl row 1: `prompt` must be"):
        load_problems(DataSpec(train_path=str(path)), "train", 0)


def test_verl_format_needs_its_columns(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "x", "answer": "1"}])
    with pytest.raises(SpecError, match=r"plain.jsonl row 1: no column `reward_model`.*"
                                        r"data.format: verl"):
        load_problems(DataSpec(train_path=str(path), format="verl"), "train", 0)


def test_inspect_shows_the_mapping(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_verl_parquet(tmp_path / "train.parquet")
    spec = tmp_path / "run.yaml"
    spec.write_text(f"data:\n  train_path: {path}\n  format: verl\n")
    assert inspect_main([str(spec)]) == 0
    out = capsys.readouterr().out
    assert "train: file (math), 9 problems" in out
    assert "read as: verl (prompt <- prompt, answer <- reward_model.ground_truth)" in out
    assert "data_source: openai/gsm8k" in out
    assert load_split(DataSpec(train_path=str(path)), "val", 0).source.read_as.startswith(
        "the published dapo_math")
