"""`marl data inspect`: the report, and exit 2 naming the field or file on user errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from marl.data.inspection import main

FIXTURES = Path(__file__).parents[1] / "fixtures"


@pytest.fixture
def spec_file(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(
        "seed: 1\n"
        "data:\n"
        "  train: dapo_math\n"
        "  val: dapo_math\n"
        f"  train_path: {FIXTURES / 'dapo_math_bad.jsonl'}\n"
        "  val_fraction: 0.4\n"
    )
    return path


def test_report_on_a_split_file(spec_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(spec_file)]) == 0
    out = capsys.readouterr().out
    assert "train and val split one set (val_fraction 0.4, seed 1)" in out
    assert "train: dapo_math (math), 2 problems" in out
    assert "val: dapo_math (math), 1 problems" in out
    assert "rows read 7, malformed 4 (skip), repeats dropped 0" in out
    assert "dapo_math_bad.jsonl row 4: not valid JSON" in out
    assert "answer formats: integer" in out
    assert out.count("  sample dapo-") == 2


def test_overrides_and_code_sets(spec_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = [str(spec_file), "data.train=deepcoder", f"data.train_path={FIXTURES / 'deepcoder'}",
            "data.val=humaneval"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "train: deepcoder (code), 7 problems" in out
    assert "test kinds: stdin/stdout" in out and "function call" in out
    assert "val: humaneval (code), 164 problems" in out
    assert "assert program 164 (100%)" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["data.on_bad_row=refuse"], "dapo_math_bad.jsonl row 2:"),
        (["data.train=gsm8k"], "field `data.train`"),
        (["data.train_path=/nope.parquet"], "`data.train_path`: '/nope.parquet' does not exist"),
        (["data.val=champ", "data.val_path=x.jsonl"], "field `data.val_path`: champ is bundled"),
        (["data.val_fraction=2"], "field `data.val_fraction`"),
        (["nonsense"], "must look like key=value"),
    ],
)
def test_user_errors_exit_2_naming_the_field(
    spec_file: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(spec_file), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_missing_or_broken_spec_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "none.yaml")]) == 2
    assert "none.yaml' does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: [unclosed\n")
    assert main([str(bad)]) == 2
    assert "not valid YAML" in capsys.readouterr().err


def test_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: marl data inspect" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "usage: marl data inspect" in capsys.readouterr().out
