"""Bad input class 4: deep nesting, non-UTF-8 files, NUL bytes and over-long file names in
specs, configs, data files and paths give an error naming the field or file, never a
RecursionError, UnicodeDecodeError or raw OS error (CLI: exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from marl.cli import main as cli
from marl.data.rows import data_files, read_rows
from marl.spec.run import SpecError, load_spec_file, load_spec_text, parse_spec
from marl.spec.services import load_service_config

DEEP_FLOW = "a: " + "[" * 20_000 + "]" * 20_000
DEEP_BLOCK = "".join(f"{'  ' * i}k{i}:\n" for i in range(200)) + "  " * 200 + "v: 1\n"
DEEP_JSON = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("text", [DEEP_FLOW, DEEP_BLOCK])
def test_deeply_nested_spec_is_a_spec_error(text: str) -> None:
    with pytest.raises(SpecError, match="nested more than 64 levels"):
        load_spec_text(text)


def test_deeply_nested_spec_mapping_is_refused_before_validation() -> None:
    data: dict = {}
    node = data
    for _ in range(5000):
        node["x"] = {}
        node = node["x"]
    with pytest.raises(SpecError, match="nested more than 64 levels"):
        parse_spec({"name": "deep", "extra": data})


def test_spec_file_not_utf8_nul_and_long_names(tmp_path: Path) -> None:
    latin = tmp_path / "spec.yaml"
    latin.write_bytes(b"name: caf\xe9\n")
    with pytest.raises(SpecError, match="not UTF-8 text"):
        load_spec_file(latin)
    with pytest.raises(SpecError, match="NUL byte"):
        load_spec_file(str(tmp_path / "a\x00b.yaml"))
    with pytest.raises(SpecError, match="at most 255"):
        load_spec_file(tmp_path / ("n" * 300 + ".yaml"))


@pytest.mark.parametrize("field, data", [
    ("out_dir", {"out_dir": "runs/a\x00b"}),
    ("model.path", {"model": {"path": "m" * 300}}),
    ("data.train_path", {"data": {"train_path": "/x/" + "d" * 256 + "/f.jsonl"}}),
    ("name", {"name": "bad\x00name"}),
])
def test_spec_paths_and_strings_are_checked(field: str, data: dict) -> None:
    with pytest.raises(SpecError, match=f"`?{field.replace('.', '[.]')}`?:"):
        parse_spec(data)


def test_validation_errors_echo_a_short_value_and_a_bounded_count() -> None:
    with pytest.raises(SpecError) as err:
        parse_spec({"seed": "z" * 1_000_000, **{f"unknown{i}": 1 for i in range(1000)}})
    message = str(err.value)
    assert len(message) < 3000 and "more" in message


def test_data_rows_nested_or_not_utf8_are_bad_rows(tmp_path: Path) -> None:
    f = tmp_path / "rows.jsonl"
    f.write_bytes(b'{"question": "1+1", "answer": "2"}\n' + DEEP_JSON.encode() + b"\n"
                  + b'{"question": "caf\xe9"}\n')
    rows = list(read_rows(f))
    assert rows[0].data is not None
    assert rows[1].data is None and "nested more than 64" in (rows[1].error or "")
    assert rows[2].data is None and "not UTF-8" in (rows[2].error or "")
    array = tmp_path / "rows.json"
    array.write_text(DEEP_JSON)
    with pytest.raises(SpecError, match="nested more than 64"):
        list(read_rows(array))
    with pytest.raises(SpecError, match="NUL byte"):
        data_files("data\x00.jsonl", "data.train_path")
    with pytest.raises(SpecError, match="at most 255"):
        data_files("x" * 400, "data.train_path")


def test_service_config_file_nested_or_not_utf8(tmp_path: Path) -> None:
    deep = tmp_path / "deep.yaml"
    deep.write_text(DEEP_FLOW)
    with pytest.raises(ValueError, match="--config.*nested"):
        load_service_config("sandbox", str(deep))
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"host: \xff\n")
    with pytest.raises(ValueError, match="--config.*not UTF-8"):
        load_service_config("sandbox", str(latin))


def test_cli_submit_exits_2_naming_the_problem(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    deep = tmp_path / "deep.yaml"
    deep.write_text(DEEP_FLOW)
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"name: \xff\n")
    for path, why in [(str(deep), "nested"), (str(latin), "not UTF-8"),
                      (str(tmp_path / "a\x00b.yaml"), "NUL byte"),
                      (str(tmp_path / ("l" * 300)), "at most 255")]:
        assert cli.main(["submit", path, "--learner", "127.0.0.1:1"]) == 2
        assert why in capsys.readouterr().err
