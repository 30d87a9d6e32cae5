"""The DeepCoder loader: every subset's `tests` layout, on fixture files in the published schema.

The fixtures carry a correct solution per problem; running it against the
converted tests (with a tiny local runner, trusted code only) shows the
conversion kept each layout's meaning.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from marl.data import load_problems, load_split
from marl.data.deepcoder import convert_tests, longest_inputs, to_problem
from marl.data.rows import RowError, read_rows
from marl.spec.run import DataSpec, SpecError

FIXTURES = Path(__file__).parents[1] / "fixtures"
FOLDER = FIXTURES / "deepcoder"
BAD = FIXTURES / "deepcoder_bad.jsonl"
SUBSETS = ("taco", "primeintellect", "lcbv5", "codeforces")


def spec(path: Path, **kw: object) -> DataSpec:
    return DataSpec(train="deepcoder", val="humaneval", train_path=str(path), **kw)  # type: ignore[arg-type]


def fixture_rows() -> list[dict[str, Any]]:
    files = [FOLDER / s / "train-00000-of-00001.parquet" for s in SUBSETS]
    return [row.data for f in files for row in read_rows(f) if row.data is not None]


def run_test(code: str, test: dict[str, Any]) -> bool:
    """Trusted fixture code only: the sandbox's job, done plainly."""
    if "stdin" in test:
        out = subprocess.run([sys.executable, "-c", code], input=test["stdin"], text=True,
                             capture_output=True, timeout=30)
        return out.stdout.strip() == test["expected_stdout"].strip()
    namespace: dict[str, Any] = {}
    exec(code, namespace)
    name = test["fn_name"]
    # as the sandbox does: a function of that name, else a method of class Solution
    fn = namespace[name] if name in namespace else getattr(namespace["Solution"](), name)
    return bool(fn(*test["args"]) == test["expected"])


def test_fixture_has_the_published_columns() -> None:
    import pyarrow.parquet as pq

    for subset in SUBSETS:
        schema = pq.read_schema(FOLDER / subset / "train-00000-of-00001.parquet")
        assert schema.names == ["problem", "solutions", "tests", "starter_code", "metadata"]
        assert str(schema.field("tests").type) == "string"
        assert str(schema.field("metadata").type) == "string"


def test_reads_a_folder_of_subsets() -> None:
    data = load_split(spec(FOLDER), "train", seed=0)
    assert len(data.problems) == 7
    assert len(data.source.files) == 4
    assert all(p.task == "code" and p.tests for p in data.problems)
    assert all(p.id.startswith("deepcoder-") for p in data.problems)


@pytest.mark.parametrize("row", fixture_rows(), ids=lambda r: r["problem"][:30])
def test_fixture_solutions_pass_their_converted_tests(row: dict[str, Any]) -> None:
    problem = to_problem(row)
    assert all(run_test(row["solutions"][0], t) for t in problem.tests)
    assert not all(run_test("print('wrong')\ndef total(xs): return -1\n"
                            "def is_even(n): return None\n"
                            "class Solution:\n    def largestSum(self, *a): return -1\n", t)
                   for t in problem.tests)


def test_each_layout_becomes_its_sandbox_form() -> None:
    kinds = {row["problem"][:12]: sorted({next(iter(t)) for t in to_problem(row).tests})
             for row in fixture_rows()}
    assert kinds == {
        "Read two int": ["stdin"],  # taco, stdin/stdout
        "Write total(": ["fn_name"],  # taco, call-based
        "The first li": ["stdin"],  # primeintellect, stdin_stdout
        "Write is_eve": ["fn_name"],  # primeintellect, function_call
        "You are give": ["stdin"],  # lcbv5, stdin
        "Given an int": ["fn_name"],  # lcbv5, functional (a method of class Solution)
        "Read an inte": ["stdin"],  # codeforces
    }


def test_layout_conversions_exactly() -> None:
    assert convert_tests({"inputs": ["1\n"], "outputs": ["2\n"]}, None, "") == [
        {"stdin": "1\n", "expected_stdout": "2\n"}]
    assert convert_tests({"inputs": [["a", "b"]], "outputs": [["c"]]}, None, "") == [
        {"stdin": "a\nb", "expected_stdout": "c"}]
    assert convert_tests({"fn_name": "f", "inputs": [[1, 2]], "outputs": [[3]]}, None, "") == [
        {"fn_name": "f", "args": [1, 2], "expected": 3}]
    assert convert_tests([{"type": "function_call", "fn_name": "g", "input": [[1]],
                           "output": [[1, 2]]}], None, "") == [
        {"fn_name": "g", "args": [[1]], "expected": [1, 2]}]
    assert convert_tests([{"type": "stdin_stdout", "input": "x", "output": "y"}], {}, "") == [
        {"stdin": "x", "expected_stdout": "y"}]
    assert convert_tests([{"input": "5\n", "output": "YES\n"}], {}, "") == [
        {"stdin": "5\n", "expected_stdout": "YES\n"}]
    assert convert_tests([{"input": "[1]\n2", "output": "3", "testtype": "functional"}],
                         {"func_name": "add"}, "") == [
        {"fn_name": "add", "args": [[1], 2], "expected": 3}]


def test_lcb_method_name_falls_back_to_the_starter_code() -> None:
    starter = "class Solution:\n    def countPairs(self, nums: List[int]) -> int:\n        "
    functional = [{"input": "[1]", "output": "0", "testtype": "functional"}]
    (test,) = convert_tests(functional, {}, starter)
    assert test == {"fn_name": "countPairs", "args": [[1]], "expected": 0}
    with pytest.raises(RowError, match="func_name"):
        convert_tests([{"input": "[1]", "output": "0", "testtype": "functional"}], {}, "")


def test_prompts_say_how_the_solution_is_run() -> None:
    prompts = {row["problem"][:12]: to_problem(row).prompt for row in fixture_rows()}
    assert "reads the input from stdin" in prompts["Read two int"]
    assert "Define a function `is_even`" in prompts["Write is_eve"]
    assert "class Solution:\n    def largestSum" in prompts["Given an int"]
    assert "def total(xs):" in prompts["Write total("]


def test_at_most_max_tests_are_kept_longest_inputs_first() -> None:
    tests = [{"stdin": "x" * n, "expected_stdout": ""} for n in (1, 5, 3, 4, 2)]
    assert [len(t["stdin"]) for t in longest_inputs(tests, 3)] == [5, 3, 4]
    row = fixture_rows()[0]
    assert len(to_problem(row, max_tests=1).tests) == 1
    problems = load_problems(spec(FOLDER, max_tests=2), "train", seed=0)
    assert max(len(p.tests) for p in problems) == 2


def test_malformed_rows_are_skipped_and_reported() -> None:
    data = load_split(spec(BAD), "train", seed=0)
    assert len(data.problems) == 1
    reasons = {b.number: b.reason for b in data.source.bad_rows}
    assert sorted(reasons) == [2, 3, 4, 5, 6]
    assert "`tests` is not valid JSON" in reasons[2]
    assert "`problem` is missing" in reasons[3]
    assert "1 inputs but 0 outputs" in reasons[4]
    assert "unknown test type 'magic'" in reasons[5]
    assert "`tests` is empty" in reasons[6]


def test_malformed_row_refuses_when_asked() -> None:
    with pytest.raises(SpecError, match=r"deepcoder_bad\.jsonl row 2: `tests` is not valid JSON"):
        load_problems(spec(BAD, on_bad_row="refuse"), "train", seed=0)


def test_tests_already_decoded_are_accepted() -> None:
    row = fixture_rows()[0]
    decoded = {**row, "tests": json.loads(row["tests"]), "metadata": json.loads(row["metadata"])}
    assert to_problem(decoded) == to_problem(row)
