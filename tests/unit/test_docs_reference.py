"""The docs' generated references (scripts/gen_reference.py) cover the whole RunSpec and CLI."""

from __future__ import annotations

import argparse
import importlib.util
import sys
import typing
from pathlib import Path
from types import ModuleType

import pytest
from pydantic import BaseModel

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gen_reference.py"


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def leaf_fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, info in model.model_fields.items():
        nested = [
            t
            for t in (info.annotation, *typing.get_args(info.annotation))
            if isinstance(t, type) and issubclass(t, BaseModel)
        ]
        if nested:
            out += leaf_fields(nested[0], f"{prefix}{name}.")
        else:
            out.append(f"{prefix}{name}")
    return out


def commands(parser: argparse.ArgumentParser, path: str = "") -> list[str]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.append(f"{path}{name}")
                out += commands(sub, f"{path}{name} ")
    return out


def test_config_page_lists_every_runspec_field_with_its_docstring(gen: ModuleType) -> None:
    fields = leaf_fields(gen.run_spec())
    assert len(fields) > 50 and "grpo.mini_batch_size" in fields
    page = gen.config_page()
    missing = [f for f in fields if f"### `{f}` {{#{f}}}" not in page]
    assert missing == []
    assert sorted(gen.config_fields()) == sorted(fields)
    assert "*(no docstring)*" not in page, "a RunSpec field has no docstring"


def test_cli_page_lists_every_subcommand(gen: ModuleType) -> None:
    parser = gen.cli_parser()
    names = commands(parser)
    assert {"demo", "up", "submit", "watch", "matrix", "cluster status"} <= set(names)
    page = gen.cli_page()
    missing = [c for c in names if f"`marl {c}` {{#marl-{c.replace(' ', '-')}}}" not in page]
    assert missing == []
    assert set(gen.cli_commands()) == set(names)


def test_write_creates_both_pages_and_rewrites_only_changed_ones(
    gen: ModuleType, tmp_path: Path
) -> None:
    written = gen.write(tmp_path)
    assert sorted(p.name for p in written) == ["cli.md", "config.md"]
    assert gen.write(tmp_path) == []
