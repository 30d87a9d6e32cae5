"""DeepCoder rows (agentica-org/DeepCoder-Preview-Dataset) as code problems.

Published columns: `problem` (the statement), `tests` (a JSON string),
`starter_code` (string, may be empty), `metadata` (a JSON string, e.g.
`{"func_name": "maxSum"}` for LiveCodeBench), `solutions` (unused). The JSON in
`tests` has one layout per subset, told apart here by its structure:

  taco            {"inputs": [...], "outputs": [...], "fn_name"?: str}
  primeintellect  [{"type": "stdin_stdout", "input": str, "output": str}, ...]
                  [{"type": "function_call", "fn_name": str, "input": [args], "output": [value]}]
  lcbv5           [{"input": str, "output": str, "testtype": "stdin" | "functional"}, ...]
                  functional: a method of `class Solution` named by metadata.func_name;
                  input is one JSON value per line (the arguments), output a JSON value
  codeforces      [{"input": str, "output": str}, ...]

They become `SandboxClient` tests: {"stdin", "expected_stdout"} or {"fn_name",
"args", "expected"}. For LiveCodeBench's methods `fn_name` is the method name: the
sandbox calls `Solution().<name>` when the code defines no function of that
name. Function-call outputs in the TACO/APPS convention wrap the return value in
a one-element list; it is unwrapped.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from marl.data.rows import RowError, require_text
from marl.problem import Problem

COLUMNS = ("problem", "tests", "starter_code", "metadata")

def _json_field(row: dict[str, Any], key: str) -> Any:
    value = row.get(key)
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            return json.loads(value)
        except json.JSONDecodeError as err:
            raise RowError(f"`{key}` is not valid JSON ({err.msg})") from None
    return value


def _text(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value)  # some TACO inputs are lists of lines
    raise RowError(f"{where} must be a string, got {type(value).__name__}")


def _unwrap(output: Any) -> Any:
    return output[0] if isinstance(output, list) and len(output) == 1 else output


def _args(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _stdio(inp: Any, out: Any, where: str) -> dict[str, Any]:
    return {"stdin": _text(inp, f"{where} input"), "expected_stdout": _text(out, f"{where} output")}


def _call(fn_name: Any, inp: Any, out: Any, where: str) -> dict[str, Any]:
    if not isinstance(fn_name, str) or not fn_name:
        raise RowError(f"{where} is a function call without a function name")
    return {"fn_name": fn_name, "args": _args(inp), "expected": _unwrap(out)}


def _method_name(metadata: Any, starter_code: str) -> str:
    if isinstance(metadata, dict) and isinstance(metadata.get("func_name"), str):
        return str(metadata["func_name"])
    m = re.search(r"^\s*def\s+([A-Za-z_]\w*)\s*\(\s*self", starter_code, re.MULTILINE)
    if m:
        return m.group(1)
    raise RowError("functional test without `metadata.func_name` or a method in `starter_code`")


def _lcb_functional(test: dict[str, Any], method: str, where: str) -> dict[str, Any]:
    try:
        args = [json.loads(line) for line in _text(test.get("input"), where).split("\n") if line]
        expected = json.loads(_text(test.get("output"), where))
    except json.JSONDecodeError as err:
        raise RowError(f"{where} is not one JSON value per line ({err.msg})") from None
    return {"fn_name": method, "args": args, "expected": expected}


def convert_tests(raw: Any, metadata: Any, starter_code: str) -> list[dict[str, Any]]:
    """DeepCoder's `tests` JSON (any subset's layout) as SandboxClient tests."""
    if isinstance(raw, dict) and "inputs" in raw and "outputs" in raw:
        inputs, outputs = raw["inputs"], raw["outputs"]
        if not isinstance(inputs, list) or not isinstance(outputs, list):
            raise RowError("`tests.inputs` and `tests.outputs` must be lists")
        if len(inputs) != len(outputs):
            raise RowError(f"`tests` has {len(inputs)} inputs but {len(outputs)} outputs")
        fn_name = raw.get("fn_name")
        return [
            _call(fn_name, i, o, f"tests[{n}]") if fn_name else _stdio(i, o, f"tests[{n}]")
            for n, (i, o) in enumerate(zip(inputs, outputs, strict=True))
        ]
    if not isinstance(raw, list):
        raise RowError("`tests` must be a JSON list of tests or an {inputs, outputs} object")
    tests = []
    for n, test in enumerate(raw):
        where = f"tests[{n}]"
        if not isinstance(test, dict) or "input" not in test or "output" not in test:
            raise RowError(f"{where} must be an object with `input` and `output`")
        kind = test.get("type") or test.get("testtype") or "stdin"
        if kind in ("stdin_stdout", "stdin"):
            tests.append(_stdio(test["input"], test["output"], where))
        elif kind == "function_call":
            tests.append(_call(test.get("fn_name"), test["input"], test["output"], where))
        elif kind == "functional":
            tests.append(_lcb_functional(test, _method_name(metadata, starter_code), where))
        else:
            raise RowError(f"{where} has unknown test type {kind!r}")
    return tests


def longest_inputs(tests: list[dict[str, Any]], keep: int) -> list[dict[str, Any]]:
    """At most `keep` tests, those with the longest inputs (DeepCoder's own reward does this)."""
    if len(tests) <= keep:
        return tests

    def size(test: dict[str, Any]) -> int:
        return len(json.dumps(test.get("stdin", test.get("args", test.get("assert_program")))))

    ranked = sorted(range(len(tests)), key=lambda i: size(tests[i]), reverse=True)[:keep]
    return [tests[i] for i in sorted(ranked)]


def prompt(problem: str, starter_code: str, tests: list[dict[str, Any]]) -> str:
    """The statement plus how the solution is run; the roles' prompts add the answer format."""
    if starter_code.strip():
        how = f"Start from this code:\n```python\n{starter_code.rstrip()}\n```"
    elif "fn_name" in tests[0]:
        how = (f"Define a function `{tests[0]['fn_name']}`; the tests call it with their "
               "arguments and compare what it returns.")
    else:
        how = "The program reads the input from stdin and writes the answer to stdout."
    return f"{problem.strip()}\n\n{how}"


def subset_of(raw: Any) -> str:
    """The DeepCoder subset whose `tests` layout `raw` has (module docstring): the dataset
    keeps no column naming it, and the paper validates on one subset."""
    if isinstance(raw, dict):
        return "taco"
    first = raw[0] if isinstance(raw, list) and raw and isinstance(raw[0], dict) else {}
    if "type" in first:
        return "primeintellect"
    return "lcbv5" if "testtype" in first else "codeforces"


def to_problem(row: dict[str, Any], max_tests: int | None = None) -> Problem:
    problem = require_text(row, "problem")
    starter = row.get("starter_code") or ""
    if not isinstance(starter, str):
        raise RowError("`starter_code` must be a string")
    raw = _json_field(row, "tests")
    tests = convert_tests(raw, _json_field(row, "metadata"), starter)
    if not tests:
        raise RowError("`tests` is empty")
    if max_tests is not None:
        tests = longest_inputs(tests, max_tests)
    digest = hashlib.sha1(problem.encode()).hexdigest()[:16]
    return Problem(id=f"deepcoder-{digest}", prompt=prompt(problem, starter, tests),
                   task="code", tests=tests, data_source=f"deepcoder_{subset_of(raw)}")
