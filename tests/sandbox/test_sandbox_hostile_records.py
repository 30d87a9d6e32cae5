"""What a program returns, raises or writes cannot break the harness's records.

Huge or deeply nested return values, exception names and messages, and raw frames
written to the harness's channel must each end in a verdict against the program
(RUNTIME_ERROR, FAILED, OUTPUT_LIMIT), never SANDBOX_ERROR or a failed call; and
the judge gives a verdict for every comparison.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.sandbox import SandboxServer, run_alongside

LIMITS = {"timeout_seconds": 10, "memory_bytes": 1 << 30, "output_bytes": 1 << 20}
CALL = [{"fn_name": "f", "args": [], "expected": 1}]
ASSERT = [{"assert_program": "def check(c):\n    assert c() == 1\n", "entry_point": "f"}]

CASES: dict[str, tuple[str, list[dict[str, Any]], str]] = {
    "return_over_the_output_limit": (
        "def f():\n    return 'a' * (20 << 20)\n", CALL, "OUTPUT_LIMIT"),
    "return_nested_too_deep": (
        "def f():\n    x = []\n    for _ in range(200000):\n        x = [x]\n    return x\n",
        CALL, "FAILED"),
    "exception_type_name_of_50_mb": (
        "def f():\n    raise type('E' * (50 << 20), (Exception,), {})()\n", CALL,
        "RUNTIME_ERROR"),
    "exception_type_name_of_50_mb_in_an_assert_program": (
        "def f():\n    raise type('E' * (50 << 20), (Exception,), {})()\n", ASSERT,
        "RUNTIME_ERROR"),
    "exception_whose_str_overflows_the_stack": (
        "def f():\n    x = []\n    for _ in range(100000):\n        x = [x]\n"
        "    raise ValueError(x)\n", CALL, "RUNTIME_ERROR"),
    "raw_frame_nested_too_deep_on_the_channel": (
        "import os, struct\ndef f():\n    data = b'[' * 200000 + b']' * 200000\n"
        "    os.write(3, struct.pack('>I', len(data)) + data)\n    return 1\n", CALL,
        "RUNTIME_ERROR"),
    "raw_frame_with_a_huge_error_on_the_channel": (
        "import os, struct, json\ndef f():\n"
        "    data = json.dumps({'raise': 'E' * (30 << 20), 'msg': 'm'}).encode()\n"
        "    os.write(3, struct.pack('>I', len(data)) + data)\n    return 1\n", CALL,
        "RUNTIME_ERROR"),
    "huge_int_against_a_float": (
        "def f():\n    return 10 ** 400\n", [{"fn_name": "f", "args": [], "expected": 1.5}],
        "FAILED"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_values_get_a_verdict_against_the_program(server: SandboxServer,
                                                          case: str) -> None:
    code, tests, verdict = CASES[case]
    result, _ = run_alongside(server, code, tests, limits=LIMITS)
    assert result.verdicts == [verdict], result.results[0]
    assert len(result.results[0].error) <= 1000


def test_tracebacks_carry_no_host_paths(server: SandboxServer) -> None:
    import sys

    from tests.support.sandbox import ROOT

    code = "import json\njson.loads('{')\n"
    result, _ = run_alongside(server, code, [{"stdin": "", "expected_stdout": ""}])
    stderr = result.results[0].stderr
    assert 'File "solution.py", line 2' in stderr and "JSONDecodeError" in stderr
    assert "<python>/lib/python3" in stderr
    for host_path in (sys.base_prefix, str(ROOT), "candidate.py"):
        assert host_path not in stderr, stderr
