"""Turn an ExecuteRequest into a validated job, split by who may see what.

- `public()`: code, stdin, function arguments and limits; this is all the jail
  (and so the candidate) gets.
- `secrets()`: the assert programs; only the harness reads them, after it has
  forked the template. (The nonces are the executor's, see `executor`.)
- `expected`: expected stdout and return values; they stay in the server.

Every user error is a ValueError naming the field, e.g.
`tests[2].function_call.args_json: not valid JSON (...)`. Numbers are strict: a
limit that is NaN or infinite is refused, and a JSON document (arguments, expected
values) may nest at most `MAX_JSON_DEPTH` lists/objects deep, so a hostile
`[[[[...` is refused by name instead of exhausting the parser's recursion.
"""

from __future__ import annotations

import ast
import json
import math
from dataclasses import dataclass, field
from typing import Any

from marl.protocol.v1 import sandbox_pb2
from marl.spec.safe_input import too_deep
from marl.spec.services import SandboxConfig

MAX_JSON_DEPTH = 100
"""Lists/objects a test's args_json or expected_json may nest (real tests use a few)."""


@dataclass(frozen=True)
class Limits:
    timeout_seconds: float
    memory_bytes: int
    output_bytes: int
    file_bytes: int


@dataclass
class Job:
    code: str
    tests: list[dict[str, Any]]
    limits: Limits
    response_output_bytes: int
    programs: dict[int, str] = field(default_factory=dict)
    expected: list[Any] = field(default_factory=list)

    def public(self) -> dict[str, Any]:
        return {"code": self.code, "tests": self.tests,
                "limits": self.limits.__dict__,
                "response_output_bytes": self.response_output_bytes}

    def secrets(self, sabotage: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"programs": {str(i): p for i, p in self.programs.items()}}
        if sabotage:
            out["expected"] = {str(i): e for i, e in enumerate(self.expected)}
        return out

    def budget(self, overhead: float) -> float:
        return len(self.tests) * (self.limits.timeout_seconds + 0.5) + overhead


def parse_limits(msg: sandbox_pb2.Limits, cfg: SandboxConfig) -> Limits:
    def pick(name: str, value: float, default: float, top: float) -> float:
        if not math.isfinite(value):
            raise ValueError(f"limits.{name}: must be a finite number (0 for the default), "
                             f"got {value}")
        if value < 0:
            raise ValueError(f"limits.{name}: must be positive (or 0 for the default)")
        if value > top:
            raise ValueError(f"limits.{name}: {value:g} is over this server's maximum {top:g}")
        return value or default

    timeout = pick("timeout_seconds", msg.timeout_seconds, cfg.default_timeout_seconds,
                   cfg.max_timeout_seconds)
    memory = int(pick("memory_bytes", msg.memory_bytes, cfg.default_memory_bytes,
                      cfg.max_memory_bytes))
    output = int(pick("output_bytes", msg.output_bytes, cfg.default_output_bytes,
                      cfg.max_output_bytes))
    if memory < 16 << 20:
        raise ValueError("limits.memory_bytes: at least 16 MiB (16777216) is needed")
    return Limits(timeout, memory, output, max(cfg.file_bytes, output + 1))


def _identifier(value: str, where: str) -> str:
    if not value.isidentifier():
        raise ValueError(f"{where}: {value!r} is not a Python identifier")
    return value


def _json(text: str, where: str) -> Any:
    try:
        value = json.loads(text)
    except RecursionError:
        value = None
    except ValueError as e:
        raise ValueError(f"{where}: not valid JSON ({e})") from None
    else:
        if not too_deep(value, MAX_JSON_DEPTH):
            return value
    raise ValueError(f"{where}: nested more than {MAX_JSON_DEPTH} lists/objects deep "
                     f"(the limit is {MAX_JSON_DEPTH})")


def _check_program(program: str, where: str) -> None:
    try:
        tree = ast.parse(program, "<assert_program>")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ValueError(f"{where}: does not compile ({e})") from None
    if not any(isinstance(n, ast.FunctionDef) and n.name == "check" for n in tree.body):
        raise ValueError(f"{where}: must define a top-level function check(candidate)")


def parse(req: sandbox_pb2.ExecuteRequest, cfg: SandboxConfig) -> Job:
    if len(req.code.encode()) > cfg.max_code_bytes:
        raise ValueError(f"code: over this server's {cfg.max_code_bytes} byte limit")
    if not req.tests:
        raise ValueError("tests: at least one test is required")
    if len(req.tests) > cfg.max_tests:
        raise ValueError(f"tests: {len(req.tests)} tests, this server takes at most "
                         f"{cfg.max_tests}")
    job = Job(req.code, [], parse_limits(req.limits, cfg), cfg.response_output_bytes)
    for i, t in enumerate(req.tests):
        kind = t.WhichOneof("kind")
        where = f"tests[{i}].{kind}"
        if kind == "stdio":
            job.tests.append({"kind": "stdio", "stdin": t.stdio.stdin})
            job.expected.append(t.stdio.expected_stdout)
        elif kind == "function_call":
            fc = t.function_call
            args = _json(fc.args_json or "[]", where + ".args_json")
            if not isinstance(args, list):
                raise ValueError(f"{where}.args_json: must be a JSON list of arguments")
            job.tests.append({"kind": "call", "args": args,
                              "fn_name": _identifier(fc.fn_name, where + ".fn_name")})
            if not fc.expected_json:
                raise ValueError(f"{where}.expected_json: required (a JSON value)")
            job.expected.append(_json(fc.expected_json, where + ".expected_json"))
        elif kind == "assert_program":
            ap = t.assert_program
            if len(ap.assert_program.encode()) > cfg.max_code_bytes:
                raise ValueError(f"{where}.assert_program: over the {cfg.max_code_bytes} "
                                 "byte limit")
            _check_program(ap.assert_program, where + ".assert_program")
            job.tests.append({"kind": "assert",
                              "entry_point": _identifier(ap.entry_point,
                                                         where + ".entry_point")})
            job.programs[i] = ap.assert_program
            job.expected.append(None)
        else:
            raise ValueError(f"tests[{i}]: set one of stdio, function_call, assert_program")
    return job
