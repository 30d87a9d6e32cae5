"""`marl up`'s learner flags are checked before any service starts, naming the flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from marl.cli.main import main


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--learners", "0"], "--learners: must be at least 1, got 0"),
        (["--max-concurrent-runs", "0"],
         "--max-concurrent-runs: Input should be greater than or equal to 1"),
        (["--max-concurrent-runs", "65"],
         "--max-concurrent-runs: Input should be less than or equal to 64"),
    ],
)
def test_bad_learner_flags_are_refused_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    assert main(["up", "--dir", str(tmp_path / "up"), *flags]) != 0
    assert message in capsys.readouterr().err
    assert not (tmp_path / "up").exists()
