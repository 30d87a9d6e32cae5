"""What honest code needs must keep working inside the jail, one property each."""

from __future__ import annotations

from typing import Any

from marl.clients import SandboxClient
from tests.support.sandbox import SandboxServer, run_alongside


def test_allow_stdin_stdout_program(client: SandboxClient) -> None:
    code = "n = int(input())\nprint(*[i * i for i in range(n)])\n"
    r = client.execute(code, [{"stdin": "4\n", "expected_stdout": "0 1 4 9\n"},
                              {"stdin": "1", "expected_stdout": "0"},
                              {"stdin": "3", "expected_stdout": "0 1 5"}])
    assert r.verdicts == ["PASSED", "PASSED", "FAILED"]
    assert abs(r.pass_rate - 2 / 3) < 1e-9


def test_allow_judge_whitespace_rules(client: SandboxClient) -> None:
    code = "print('a b  ')\nprint('c\\r')\nprint()\nprint()\n"
    r = client.execute(code, [{"stdin": "", "expected_stdout": "a b\nc"},
                              {"stdin": "", "expected_stdout": " a b\nc"}])
    assert r.verdicts == ["PASSED", "FAILED"]


def test_allow_main_guard_and_sys_exit_zero(client: SandboxClient) -> None:
    code = ("import sys\ndef main():\n    print(sum(map(int, sys.stdin.read().split())))\n"
            "    sys.exit(0)\nif __name__ == '__main__':\n    main()\n")
    r = client.execute(code, [{"stdin": "2 3", "expected_stdout": "5"}])
    assert r.verdicts == ["PASSED"]


def test_allow_function_call_and_solution_class(client: SandboxClient) -> None:
    code = ("from typing import List\nclass Solution:\n"
            "    def twoSum(self, nums: List[int], target: int) -> List[int]:\n"
            "        seen = {}\n        for i, x in enumerate(nums):\n"
            "            if target - x in seen:\n                return [seen[target - x], i]\n"
            "            seen[x] = i\n        return []\n")
    cases = [([[2, 7, 11, 15], 9], [0, 1]), ([[3, 3], 6], [0, 1]), ([[1, 2], 9], [0, 1])]
    r = client.execute(code, [{"fn_name": "twoSum", "args": a, "expected": e} for a, e in cases])
    assert r.verdicts == ["PASSED", "PASSED", "FAILED"]


def test_allow_json_values_tuples_dicts_floats(client: SandboxClient) -> None:
    code = ("def f(d):\n    return {'keys': sorted(d), 'pair': (1, 2.0), 'x': 0.1 + 0.2, "
            "'ok': True, 'none': None}\n")
    expected = {"keys": ["a", "b"], "pair": [1, 2], "x": 0.3, "ok": True, "none": None}
    r = client.execute(code, [{"fn_name": "f", "args": [{"b": 1, "a": 2}], "expected": expected}])
    assert r.verdicts == ["PASSED"]


def test_allow_assert_program_humaneval_style(client: SandboxClient) -> None:
    code = "def add(a: int, b: int) -> int:\n    return a + b\n"
    program = ("METADATA = {}\n\ndef check(candidate):\n    assert candidate(2, 3) == 5\n"
               "    assert candidate(-1, 1) == 0\n")
    r = client.execute(code, [{"assert_program": program, "entry_point": "add"}])
    assert r.verdicts == ["PASSED"]


def test_allow_assert_program_expects_exception(client: SandboxClient) -> None:
    code = ("def root(x):\n    if x < 0:\n        raise ValueError('negative')\n"
            "    return x ** 0.5\n")
    program = ("def check(candidate):\n    assert candidate(4) == 2\n    try:\n"
               "        candidate(-1)\n    except ValueError:\n        pass\n    else:\n"
               "        assert False\n")
    r = client.execute(code, [{"assert_program": program, "entry_point": "root"}])
    assert r.verdicts == ["PASSED"]


def test_allow_assert_program_uses_helpers_from_code(client: SandboxClient) -> None:
    code = ("def encode(s):\n    return s[::-1]\n\ndef decode(s):\n    return s[::-1]\n")
    program = "def check(candidate):\n    assert candidate(encode('abc')) == 'abc'\n"
    r = client.execute(code, [{"assert_program": program, "entry_point": "decode"}])
    assert r.verdicts == ["PASSED"]


def test_allow_in_place_mutation_seen_by_check(client: SandboxClient) -> None:
    code = "def sort_in_place(xs):\n    xs.sort()\n"
    program = ("def check(candidate):\n    xs = [3, 1, 2]\n    candidate(xs)\n"
               "    assert xs == [1, 2, 3]\n")
    r = client.execute(code, [{"assert_program": program, "entry_point": "sort_in_place"}])
    assert r.verdicts == ["PASSED"]


def test_allow_threads(client: SandboxClient) -> None:
    code = ("import threading\nout = []\nts = [threading.Thread(target=out.append, args=(i,)) "
            "for i in range(8)]\nfor t in ts: t.start()\nfor t in ts: t.join()\n"
            "print(sorted(out))\n")
    r = client.execute(code, [{"stdin": "", "expected_stdout": str(list(range(8)))}])
    assert r.verdicts == ["PASSED"]


def test_allow_scratch_files(client: SandboxClient) -> None:
    code = ("import os, tempfile\nwith open('notes.txt', 'w') as f:\n    f.write('hi')\n"
            "with tempfile.NamedTemporaryFile('w+') as t:\n    t.write('there')\n    t.seek(0)\n"
            "    print(open('notes.txt').read(), t.read())\n")
    r = client.execute(code, [{"stdin": "", "expected_stdout": "hi there"}])
    assert r.verdicts == ["PASSED"], r


def test_allow_standard_library(client: SandboxClient) -> None:
    code = ("import fractions, json, sqlite3, zlib, decimal, collections, heapq, itertools\n"
            "db = sqlite3.connect(':memory:')\nprint(db.execute('select 6*7').fetchone()[0], "
            "fractions.Fraction(1, 3) * 3, len(zlib.compress(b'x' * 100)) < 100)\n")
    r = client.execute(code, [{"stdin": "", "expected_stdout": "42 1 True"}])
    assert r.verdicts == ["PASSED"], r


def test_allow_deep_recursion(client: SandboxClient) -> None:
    code = ("import sys\nsys.setrecursionlimit(20000)\ndef depth(n):\n"
            "    return 0 if n == 0 else 1 + depth(n - 1)\nprint(depth(10000))\n")
    r = client.execute(code, [{"stdin": "", "expected_stdout": "10000"}])
    assert r.verdicts == ["PASSED"], r


def test_allow_memory_within_limit(client: SandboxClient) -> None:
    code = "x = bytearray(100 << 20)\nprint(len(x) >> 20)\n"
    r = client.execute(code, [{"stdin": "", "expected_stdout": "100"}],
                       limits={"memory_bytes": 256 << 20})
    assert r.verdicts == ["PASSED"], r


def test_allow_unicode_output(client: SandboxClient) -> None:
    code = "s = input()\nprint(s[::-1], 'π≈3.14', '🙂')\n"
    r = client.execute(code, [{"stdin": "żółw\n", "expected_stdout": "włóż π≈3.14 🙂"}])
    assert r.verdicts == ["PASSED"]


def test_allow_crash_in_one_test_spares_the_next(client: SandboxClient) -> None:
    code = ("import time\ndef f(x):\n    if x == 1:\n        while True:\n            pass\n"
            "    if x == 2:\n        raise KeyError(x)\n    return x\n")
    tests: list[dict[str, Any]] = [{"fn_name": "f", "args": [x], "expected": x} for x in range(4)]
    r = client.execute(code, tests, limits={"timeout_seconds": 1})
    assert r.verdicts == ["PASSED", "TIMEOUT", "RUNTIME_ERROR", "PASSED"]


def test_allow_compile_error_is_reported(client: SandboxClient) -> None:
    r = client.execute("def f(:\n", [{"stdin": "", "expected_stdout": ""},
                                     {"fn_name": "f", "args": [], "expected": 1}])
    assert r.verdicts == ["COMPILE_ERROR", "COMPILE_ERROR"]
    assert "SyntaxError" in r.results[0].stderr


def test_allow_benign_job_beside_another(server: SandboxServer) -> None:
    result, _ = run_alongside(server, "print(input())", [{"stdin": "x", "expected_stdout": "x"}])
    assert result.verdicts == ["PASSED"]
