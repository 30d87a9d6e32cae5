"""Reading what users hand marl (specs, data files, paths) without raw Python or OS errors.

A spec or data file nested thousands deep (`[[[[...]]]]`) makes PyYAML's and
json's recursive parsers raise RecursionError, and anything that walks the
result afterwards (pydantic, our own code) would too; a file that is not
UTF-8, a NUL byte in a path, or a file name longer than the filesystem allows
raise UnicodeDecodeError / ValueError / OSError with messages that name
nothing the user wrote. Here each is a ValueError (or the caller's subclass,
e.g. SpecError) naming the field or file and what to do. Values echoed back
are shortened so an error never carries a whole hostile input.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

MAX_DEPTH = 64
"""Nesting (mappings and lists) a spec, config or data row may have; real ones use < 10."""
MAX_NAME_BYTES = 255
MAX_PATH_BYTES = 4096


def shorten(value: Any, limit: int = 120) -> str:
    """repr(value), cut to about `limit` characters."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= limit:
        return text if isinstance(value, str) else text
    return f"{text[:limit]}... ({len(text)} characters)"


def too_deep(data: Any, max_depth: int = MAX_DEPTH) -> bool:
    """Whether `data` nests mappings/lists deeper than `max_depth` (checked without recursion)."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list | tuple):
            children = node
        else:
            continue
        if depth > max_depth:
            return True
        stack.extend((c, depth + 1) for c in children)
    return False


def _check_parsed(data: Any, what: str, error: type[Exception]) -> Any:
    if too_deep(data):
        raise error(f"{what}: nested more than {MAX_DEPTH} levels deep; flatten it")
    return data


_CONSTRUCT_ERRORS = (ValueError, TypeError, AttributeError, KeyError, IndexError, OverflowError)
"""What PyYAML's safe constructors raise, unwrapped, for an explicitly tagged scalar they
cannot convert (`!!int x`: ValueError, `!!bool x`: KeyError, `!!timestamp x`: AttributeError)."""


class AliasRefused(ValueError):
    """A YAML anchor (`&a`) or alias (`*a`): refused as soon as the parser meets it."""


@functools.lru_cache(maxsize=1)
def _loader() -> type:
    """PyYAML's SafeLoader that refuses anchors and aliases where it meets them.

    An alias makes a node appear again wherever it is named, so a few hundred bytes of
    nested aliases (a "billion laughs") expand to gigabytes of objects, and everything that
    walks them (pydantic, our checks, `yaml.dump`) takes minutes. No run spec or service
    config needs them, and refusing at the first event costs nothing."""
    import yaml
    from yaml.events import AliasEvent, CollectionStartEvent, ScalarEvent

    class NoAliasLoader(yaml.SafeLoader):
        def compose_node(self, parent: Any, index: Any) -> Any:
            event = self.peek_event()
            if isinstance(event, AliasEvent) or (
                    isinstance(event, ScalarEvent | CollectionStartEvent) and event.anchor):
                mark = event.start_mark
                where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
                raise AliasRefused(
                    f"YAML anchors and aliases (&name, *name) are not accepted{where}; "
                    "write the values out")
            return super().compose_node(parent, index)

    return NoAliasLoader


def load_yaml(text: str, what: str, error: type[Exception] = ValueError) -> Any:
    """YAML `text` parsed safely; a YAML, tag, nesting, alias or NUL problem is `error`
    naming `what` (and, for a tagged value that cannot be converted, the field and the
    line)."""
    import yaml

    try:
        data = yaml.load(text, Loader=_loader())  # a SafeLoader
    except AliasRefused as err:
        raise error(f"{what}: {err}") from None
    except yaml.YAMLError as err:
        raise error(f"{what} is not valid YAML: {shorten(str(err), 400)}") from None
    except RecursionError:
        raise error(f"{what}: nested more than {MAX_DEPTH} levels deep; flatten it") from None
    except _CONSTRUCT_ERRORS:
        raise error(f"{what}: {_bad_tagged_value(text)}") from None
    return _check_parsed(data, what, error)


def _bad_tagged_value(text: str) -> str:
    """Which tagged scalar of `text` PyYAML cannot convert, as `field `a.b`: ...`.

    Only called once `safe_load` failed while constructing, so the text composes; the node
    tree is walked without recursion and each scalar converted on its own."""
    import yaml

    root = yaml.compose(text, Loader=_loader())
    constructor = yaml.constructor.SafeConstructor()
    stack: list[tuple[Any, str]] = [(root, "")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, yaml.MappingNode):
            for key, value in reversed(node.value):
                name = key.value if isinstance(key, yaml.ScalarNode) else "?"
                stack.append((value, f"{where}.{shorten(str(name), 60)}".lstrip(".")))
                stack.append((key, where))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((v, f"{where}[{i}]") for i, v in reversed(list(enumerate(node.value))))
        elif isinstance(node, yaml.ScalarNode):
            try:
                constructor.construct_object(node, deep=True)
            except _CONSTRUCT_ERRORS:
                tag = node.tag.rsplit(":", 1)[-1]
                mark = node.start_mark
                return (f"field `{where or '(top level)'}`: {shorten(node.value, 60)!r} is not a "
                        f"valid !!{tag} value (line {mark.line + 1}, column {mark.column + 1}); "
                        "fix the value or remove the tag")
    return "a tagged value cannot be converted; check the `!!` tags"


def load_json(text: str | bytes, what: str, error: type[Exception] = ValueError) -> Any:
    """JSON `text` parsed safely; a syntax or nesting problem is `error` naming `what`."""
    try:
        return _check_parsed(json.loads(text), what, error)
    except RecursionError:
        raise error(f"{what}: nested more than {MAX_DEPTH} levels deep; flatten it") from None
    except json.JSONDecodeError as err:
        raise error(f"{what} is not valid JSON ({err})") from None
    except UnicodeDecodeError:
        raise error(f"{what} is not UTF-8 text") from None


def check_path(path: str | Path, field: str, error: type[Exception] = ValueError) -> Path:
    """`path` if the OS could accept it: no NUL byte, no over-long name; else `error`."""
    text = str(path)
    if "\x00" in text:
        raise error(f"{field}: the path {shorten(text)!r} contains a NUL byte")
    try:
        raw = text.encode("utf-8")
    except UnicodeEncodeError:
        raise error(f"{field}: the path {shorten(text)!r} is not valid UTF-8") from None
    if len(raw) > MAX_PATH_BYTES:
        raise error(f"{field}: the path is {len(raw)} bytes long; the limit is {MAX_PATH_BYTES}")
    long = next((p for p in Path(text).parts if len(p.encode()) > MAX_NAME_BYTES), None)
    if long is not None:
        raise error(f"{field}: the name {shorten(long, 60)!r} is {len(long.encode())} bytes "
                    f"long; a file name may have at most {MAX_NAME_BYTES}")
    return Path(text)


def read_text(path: str | Path, field: str, error: type[Exception] = ValueError) -> str:
    """The UTF-8 text of the file at `path`; any problem is `error` naming `field` and the file."""
    p = check_path(path, field, error)
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise error(f"{field}: {shorten(str(p))} is not UTF-8 text (byte {err.start}); "
                    "save it as UTF-8") from None
    except OSError as err:
        raise error(f"{field}: cannot read {shorten(str(p))}: {err.strerror}") from None


def nul_in_strings(data: Any) -> str | None:
    """The dotted field of the first string (or key) holding a NUL byte, else None."""
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, str):
            if "\x00" in node:
                return where or "(top level)"
        elif isinstance(node, dict):
            for k, v in node.items():
                key = str(k)
                if "\x00" in key:
                    return f"{where}.{shorten(key, 40)}".lstrip(".")
                stack.append((v, f"{where}.{key}".lstrip(".")))
        elif isinstance(node, list | tuple):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(node))
    return None
