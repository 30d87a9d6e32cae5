"""The CLI as a new user meets it: `--version`, help for every argument, real subcommands,
one error prefix, a spec checked before any learner is called, and the learner's address
found from `--learner`, `$MARL_LEARNER` or `./marl-up/endpoints.json`."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

import marl
from marl.cli import learner_address
from marl.cli.main import build_parser, main
from marl.runtime.processes import free_port


def parsers(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, (*path, name))


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory with no marl-up/ and no $MARL_LEARNER."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MARL_LEARNER", raising=False)
    return tmp_path


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"marl {marl.__version__}"


def test_every_option_and_positional_has_help() -> None:
    missing = [
        f"marl {' '.join(path)} {action.option_strings or action.dest}"
        for path, parser in parsers(build_parser())
        for action in parser._actions
        if not (action.help and action.help.strip()) and action.help != argparse.SUPPRESS
    ]
    assert missing == []


@pytest.mark.parametrize(
    ("tool", "action", "option"),
    [("data", "inspect", "spec"), ("sandbox", "doctor", "--json"), ("sandbox", "run", "--stdin"),
     ("model", "import", "--force")],
)
def test_tools_are_real_subcommands(
    tool: str, action: str, option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main([tool, action, "--help"])
    out = capsys.readouterr().out
    assert out.startswith(f"usage: marl {tool} {action}") and option in out


def test_sandbox_doctor_reaches_its_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sandbox", "doctor", "--json"]) == 0
    assert "tier" in json.loads(capsys.readouterr().out)


def test_one_error_prefix(elsewhere: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:  # argparse's own error, in a subcommand
        main(["data", "inspect"])
    assert done.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "marl: error: the following arguments are required: spec")
    assert main(["report", str(elsewhere / "none")]) == 2  # a user error the command finds
    assert capsys.readouterr().err.startswith("marl: error: ")
    assert main(["data", "inspect", str(elsewhere / "none.yaml")]) == 2
    assert capsys.readouterr().err.startswith("marl: error: ")


def test_submit_names_a_misspelt_field_before_calling_any_learner(
    elsewhere: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = elsewhere / "run.yaml"
    spec.write_text("workflow: voting\ntrain:\n  stpes: 3\n")
    assert main(["submit", str(spec)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("marl: error: ") and "train.stpes" in err
    assert "not reachable" not in err
    assert main(["submit", "run.yaml", "sampling.temprature=0.5"]) == 2
    assert "sampling.temprature" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["watch", "run-x"], ["status", "run-x"], ["runs"],
                                     ["cancel", "run-x"]])
def test_no_learner_is_one_line_and_exit_2(
    elsewhere: Path, command: list[str], capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    address = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("MARL_LEARNER", address)
    assert main(command) == 2
    out, err = capsys.readouterr()
    assert out == ""  # no table, no "step 0/0"
    assert len(err.strip().splitlines()) == 1
    assert err.startswith(f"marl: error: the learner at {address} is not reachable")
    assert "$MARL_LEARNER" in err


def test_the_address_comes_from_flag_then_env_then_marl_up(
    elsewhere: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    found = learner_address.resolve(None)
    assert (found.address, found.source) == ("127.0.0.1:50051", "the default")
    assert "./marl-up/endpoints.json: no such file" in found.explain()
    (elsewhere / "marl-up").mkdir()
    (elsewhere / "marl-up" / "endpoints.json").write_text(json.dumps({"learner": "127.0.0.1:7"}))
    found = learner_address.resolve(None)
    assert (found.address, found.source) == ("127.0.0.1:7", "./marl-up/endpoints.json")
    monkeypatch.setenv("MARL_LEARNER", "10.0.0.1:9")
    assert learner_address.resolve(None).address == "10.0.0.1:9"
    assert learner_address.resolve("h:1").address == "h:1"
    (elsewhere / "marl-up" / "endpoints.json").write_text("{broken")
    monkeypatch.delenv("MARL_LEARNER")
    assert main(["runs"]) == 2  # an unreadable endpoints.json is named, never guessed past
