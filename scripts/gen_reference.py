"""Write the docs' configuration and CLI references from the code.

`docs/reference/config.md` walks the RunSpec tree: every field's dotted name, type,
bounds, default and docstring (pydantic keeps no attribute docstrings unless told to, so
they are read from each model class's source with `ast`). `docs/reference/cli.md` walks
the `marl` argparse parser: every subcommand, nested ones too, with its usage and
arguments. Both pages are generated, never edited by hand, and git-ignored.

    python scripts/gen_reference.py [DOCS_DIR]     # default: docs/ beside this script

mkdocs runs this file as a hook (`hooks:` in mkdocs.yml): `on_pre_build` regenerates
both pages before every build, writing a page only when its text changed so that
`mkdocs serve` does not rebuild in a loop.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import os
import sys
import textwrap
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parent.parent
SPEC_MODULES = ("marl.spec.run",)
"""Where RunSpec lives."""
HELP_COLUMNS = "100"
"""argparse wraps usage lines at $COLUMNS: fixed so the page does not depend on a terminal."""


# ---------------------------------------------------------------- the RunSpec tree


@dataclass
class ConfigField:
    name: str
    """Dotted name, e.g. `grpo.mini_batch_size`."""
    type: str
    bounds: str
    default: str
    doc: str


@dataclass
class ConfigSection:
    name: str
    """Dotted name of the section; "" for the top level."""
    doc: str
    fields: list[ConfigField]


def run_spec() -> type[BaseModel]:
    for name in SPEC_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        spec = getattr(module, "RunSpec", None)
        if isinstance(spec, type) and issubclass(spec, BaseModel):
            return spec
    raise ImportError(f"no RunSpec in {' or '.join(SPEC_MODULES)}")


def attribute_docstrings(model: type[BaseModel]) -> dict[str, str]:
    """Field name -> the string literal right below its annotated assignment, through
    the class's bases (a subclass's docstring wins)."""
    docs: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or cls is BaseModel:
            continue
        try:
            source = textwrap.dedent(inspect.getsource(cls))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0]
        assert isinstance(body, ast.ClassDef)
        for stmt, after in zip(body.body, [*body.body[1:], None], strict=True):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs


def type_name(tp: Any) -> str:
    """A reader's spelling of an annotation: `int`, `float | None`, `"a" | "b"`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if tp is type(None):
        return "None"
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_name(a) for a in args)}]" if args else name
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def bounds_of(info: FieldInfo) -> str:
    marks = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}
    out = []
    for meta in info.metadata:
        for attr, mark in marks.items():
            value = getattr(meta, attr, None)
            if value is not None:
                out.append(f"{mark} {value}")
        for attr, label in (("min_length", "length ≥"), ("max_length", "length ≤")):
            value = getattr(meta, attr, None)
            if value is not None:
                out.append(f"{label} {value}")
        pattern = getattr(meta, "pattern", None)
        if pattern is not None:
            out.append(f"matches `{pattern}`")
    return ", ".join(out)


def default_of(info: FieldInfo) -> str:
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
    elif info.default is PydanticUndefined:
        return "required"
    else:
        value = info.default
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps(value, ensure_ascii=False)


def submodel(tp: Any) -> type[BaseModel] | None:
    """The model a field holds (`WandbSpec | None` holds WandbSpec), if any."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp
    for arg in typing.get_args(tp):
        found = submodel(arg)
        if found is not None:
            return found
    return None


def config_sections(model: type[BaseModel] | None = None, prefix: str = "") -> list[ConfigSection]:
    """The RunSpec's sections, depth first: the top level, then each nested model."""
    model = model or run_spec()
    docs = attribute_docstrings(model)
    own = ConfigSection(prefix, inspect.cleandoc(model.__doc__ or ""), [])
    nested: list[ConfigSection] = []
    for name, info in model.model_fields.items():
        dotted = f"{prefix}{name}"
        sub = submodel(info.annotation)
        doc = info.description or docs.get(name, "")
        if sub is not None:
            child = config_sections(sub, f"{dotted}.")
            if doc:
                child[0].doc = f"{doc}\n\n{child[0].doc}".strip()
            if info.annotation is not sub:  # optional: unset unless the spec names it
                child[0].doc = f"{child[0].doc}\n\nDefault: `{default_of(info)}`.".strip()
            nested.extend(child)
            continue
        own.fields.append(
            ConfigField(dotted, type_name(info.annotation), bounds_of(info), default_of(info), doc)
        )
    return [own, *nested]


def config_fields() -> list[str]:
    """Every leaf field's dotted name."""
    return [f.name for s in config_sections() for f in s.fields]


def config_page() -> str:
    spec = run_spec()
    lines = [
        "# Configuration reference",
        "",
        "<!-- generated by scripts/gen_reference.py from "
        f"{spec.__module__}.RunSpec; do not edit -->",
        "",
        "A run spec is YAML that names only the fields it changes; every other field keeps "
        "the default below (the paper's Table 7 where the paper has one). On the command "
        "line, `key=value` overrides take the dotted names: "
        "`marl demo policy=isolated grpo.group_size=4`. A wrong value or an unknown key is "
        "refused with the field named (exit 2; `INVALID_ARGUMENT` over gRPC). The resolved "
        "spec is written next to the run's outputs as `run.yaml`.",
        "",
    ]
    for section in config_sections(spec):
        name = section.name.rstrip(".")
        lines += [f"## `{name}` {{#{name}}}" if name else "## Top level {#top-level}", ""]
        if section.doc:
            lines += [prose(section.doc), ""]
        for f in section.fields:
            kind = f"`{f.type}`" + (f", {f.bounds}" if f.bounds else "")
            lines += [
                f"### `{f.name}` {{#{f.name}}}",
                "",
                f"{kind} · default `{f.default}`",
                "",
                prose(f.doc) if f.doc else "*(no docstring)*",
                "",
            ]
    return "\n".join(lines).rstrip() + "\n"


# ---------------------------------------------------------------- the CLI


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def cli_parser() -> argparse.ArgumentParser:
    """The `marl` parser: `build_parser()` where the CLI module has one; otherwise the one
    the console script's `main` parses with, caught as it starts parsing."""
    module = importlib.import_module("marl.cli.main")
    build = getattr(module, "build_parser", None)
    if callable(build):
        parser = build()
        assert isinstance(parser, argparse.ArgumentParser)
        return parser
    from importlib.metadata import entry_points

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "marl"]
    main = script.load()

    def capture(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Captured(self)

    saved = argparse.ArgumentParser.parse_known_args
    argparse.ArgumentParser.parse_known_args = capture  # type: ignore[method-assign]
    try:
        main(["--help"])
    except _Captured as caught:
        return caught.parser
    finally:
        argparse.ArgumentParser.parse_known_args = saved  # type: ignore[method-assign]
    raise RuntimeError("marl's main() parsed no arguments")


def subcommands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], str, argparse.ArgumentParser]]:
    """(("cluster", "status"), help, parser) for every subcommand, depth first."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {a.dest: a.help or "" for a in action._choices_actions}
        seen: set[int] = set()
        for name, sub in action.choices.items():
            if id(sub) in seen:  # an alias
                continue
            seen.add(id(sub))
            yield (*path, name), helps.get(name, ""), sub
            yield from subcommands(sub, (*path, name))


def cli_commands() -> list[str]:
    """Every subcommand as typed: `demo`, `cluster status`, ..."""
    return [" ".join(path) for path, _, _ in subcommands(cli_parser())]


def prose(text: str) -> str:
    """Text from a docstring or a help string as Markdown: `<` and `>` outside code spans
    escaped, so `runs/demo-<time>` is not read as an HTML tag."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def _cell(text: str) -> str:
    return prose(" ".join(text.split())).replace("|", "\\|")


def _argument(action: argparse.Action) -> str:
    if action.option_strings:
        names = ", ".join(action.option_strings)
        if action.nargs == 0:
            return f"`{names}`"
        metavar = action.metavar or action.dest.upper()
        if action.choices is not None and action.metavar is None:
            metavar = "{" + ",".join(map(str, action.choices)) + "}"
        return f"`{names} {metavar}`"
    name = action.metavar or action.dest
    if action.choices is not None and action.metavar is None:
        name = "{" + ",".join(map(str, action.choices)) + "}"
    if action.nargs in ("*", "+"):
        name += " ..."
    elif action.nargs == "?":
        name = f"[{name}]"
    return f"`{name}`"


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help:
        return ""
    try:
        return parser._get_formatter()._expand_help(action)
    except (KeyError, TypeError, ValueError):
        return action.help


def _default(action: argparse.Action) -> str:
    """The default column: the value, or what leaving the argument out means."""
    if action.required:
        return "required"
    if not action.option_strings:
        return "optional"
    if action.nargs == 0 and action.default is False:  # a switch
        return "off"
    if action.default is None or action.default == "" or action.default is argparse.SUPPRESS:
        return "unset"
    return f"`{action.default}`"


def cli_page() -> str:
    os.environ["COLUMNS"] = HELP_COLUMNS
    parser = cli_parser()
    lines = [
        "# CLI reference",
        "",
        "<!-- generated by scripts/gen_reference.py from marl's argparse parser; do not edit -->",
        "",
        "`marl` exits 0 on success and 2 on a user error, naming the field or argument and "
        "the fix. It parses its arguments before it imports torch, so `--help` and spec "
        "checks are instant. Commands that take a run spec also take `key=value` overrides "
        "of its fields (see the [configuration reference](config.md)).",
        "",
        "```text",
        parser.format_usage().strip(),
        "```",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    commands = list(subcommands(parser))
    for path, helptext, _ in commands:
        anchor = "marl-" + "-".join(path)
        lines.append(f"| [`marl {' '.join(path)}`](#{anchor}) | {_cell(helptext)} |")
    lines.append("")
    for path, helptext, sub in commands:
        anchor = "marl-" + "-".join(path)
        level = "#" * min(2 + len(path) - 1, 4)
        lines += [f"{level} `marl {' '.join(path)}` {{#{anchor}}}", ""]
        if helptext:
            lines += [prose(helptext), ""]
        if sub.description and sub.description != helptext:
            lines += [prose(inspect.cleandoc(sub.description)), ""]
        lines += ["```text", sub.format_usage().strip(), "```", ""]
        rows = [
            (a, _help(sub, a))
            for a in sub._actions
            if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)
            and a.help != argparse.SUPPRESS
        ]
        if rows:
            lines += ["| argument | default | description |", "|---|---|---|"]
            for action, text in rows:
                lines.append(f"| {_argument(action)} | {_default(action)} | {_cell(text)} |")
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


# ---------------------------------------------------------------- writing


def write(docs_dir: Path) -> list[Path]:
    """Write both pages under docs_dir/reference; return the ones whose text changed."""
    out = docs_dir / "reference"
    out.mkdir(parents=True, exist_ok=True)
    changed = []
    for name, text in (("config.md", config_page()), ("cli.md", cli_page())):
        path = out / name
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            changed.append(path)
    return changed


def on_pre_build(config: Any, **_: Any) -> None:
    """mkdocs hook: regenerate the references before the docs are read."""
    write(Path(config["docs_dir"]))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    docs_dir = Path(args[0]) if args else ROOT / "docs"
    for path in write(docs_dir):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
