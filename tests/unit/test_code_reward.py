"""The code reward: which block is the answer, and how the sandbox's verdict becomes a reward."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from marl.rewards.code_scoring import SandboxFailure, compiles, extract_code, python_blocks, score

FENCE = "```"


@pytest.mark.parametrize(
    ("response", "want"),
    [
        (f"Here:\n{FENCE}python\nprint(1)\n{FENCE}\n", "print(1)"),
        (f"{FENCE}py\nx = 1\n{FENCE}", "x = 1"),
        (f"{FENCE}Python3\nx = 3\n{FENCE}", "x = 3"),
        (f"{FENCE}\nuntagged = True\n{FENCE}", "untagged = True"),
        (f"{FENCE}python\na = 1\n{FENCE}\nthen\n{FENCE}python\nb = 2\n{FENCE}", "b = 2"),
        (f"{FENCE}python\ncode = 1\n{FENCE}\nOutput:\n{FENCE}text\n3\n{FENCE}", "code = 1"),
        (f"{FENCE}python\nkept = 1\n{FENCE}\n{FENCE}python\ntruncated = (", "kept = 1"),
        (f"{FENCE}python\ndef f():\n    return 1{FENCE}", "def f():\n    return 1"),
        (f"````python\ns = '''\n{FENCE}\n'''\n````", f"s = '''\n{FENCE}\n'''"),
        (f"1. Step\n  {FENCE}python\n  y = 2\n  {FENCE}", "  y = 2"),
        (f"{FENCE}python\n\n{FENCE}\n{FENCE}python\nlast = 1\n{FENCE}\n{FENCE}python\n{FENCE}",
         "last = 1"),
        ("inline ```python x``` is not a block", None),
        ("no code at all", None),
        (f"{FENCE}bash\nls\n{FENCE}", None),
        (f"{FENCE}python\nnever closed", None),
    ],
)
def test_extract_code(response: str, want: str | None) -> None:
    assert extract_code(response) == want


def test_python_blocks_keeps_order_and_skips_other_languages() -> None:
    text = f"{FENCE}python\na\n{FENCE}\n{FENCE}json\n{{}}\n{FENCE}\n{FENCE}\nb\n{FENCE}"
    assert python_blocks(text) == ["a", "b"]


def test_compiles_parses_without_running() -> None:
    assert compiles("import os\nos._exit(3)")  # would kill the test process if it ran
    assert not compiles("def f(:\n  pass")
    assert not compiles("x = (" * 10_000)
    assert not compiles("a = '\x00'")  # null byte in source


@dataclass
class FakeResult:
    pass_rate: float
    verdicts: list[str] = field(default_factory=list)


@dataclass
class FakeSandbox:
    pass_rate: float = 1.0
    verdicts: list[Any] = field(default_factory=list)
    calls: list[tuple[str, list[dict[str, Any]], Any]] = field(default_factory=list)

    async def execute(
        self, code: str, tests: list[dict[str, Any]], limits: Any = None
    ) -> FakeResult:
        self.calls.append((code, tests, limits))
        return FakeResult(self.pass_rate, self.verdicts)


TESTS = [{"stdin": "1\n", "expected_stdout": "2\n"}, {"stdin": "2\n", "expected_stdout": "3\n"}]
ANSWER = f"I add one.\n{FENCE}python\nprint(int(input()) + 1)\n{FENCE}"


async def test_score_is_the_sandbox_pass_rate() -> None:
    sandbox = FakeSandbox(pass_rate=0.5)
    assert await score(ANSWER, TESTS, sandbox) == 0.5
    assert sandbox.calls == [("print(int(input()) + 1)", TESTS, None)]


async def test_full_marks() -> None:
    assert await score(ANSWER, TESTS, FakeSandbox(pass_rate=1.0)) == 1.0


async def test_no_code_block_scores_zero_without_a_sandbox_call() -> None:
    sandbox = FakeSandbox()
    assert await score("print(1)  # not fenced", TESTS, sandbox) == 0.0
    assert sandbox.calls == []


async def test_syntax_error_scores_zero_without_a_sandbox_call() -> None:
    sandbox = FakeSandbox()
    assert await score(f"{FENCE}python\ndef broken(:\n{FENCE}", TESTS, sandbox) == 0.0
    assert sandbox.calls == []


async def test_runtime_failures_and_timeouts_are_the_sandboxs_zero() -> None:
    sandbox = FakeSandbox(pass_rate=0.0)  # every test crashed or timed out
    assert await score(ANSWER, TESTS, sandbox) == 0.0
    assert len(sandbox.calls) == 1


async def test_pass_rate_is_clamped() -> None:
    assert await score(ANSWER, TESTS, FakeSandbox(pass_rate=1.5)) == 1.0
    assert await score(ANSWER, TESTS, FakeSandbox(pass_rate=-1.0)) == 0.0


async def test_a_problem_without_tests_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one test"):
        await score(ANSWER, [], FakeSandbox())


@pytest.mark.parametrize("verdict", ["SANDBOX_ERROR", 8])
async def test_a_sandbox_failure_is_not_a_zero(verdict: Any) -> None:
    sandbox = FakeSandbox(pass_rate=0.5, verdicts=["PASSED", verdict])
    with pytest.raises(SandboxFailure):
        await score(ANSWER, TESTS, sandbox)


async def test_failed_verdicts_are_just_a_lower_pass_rate() -> None:
    for failed in ("FAILED", "RUNTIME_ERROR", "MEMORY_LIMIT", "OUTPUT_LIMIT", 2, 4):
        sandbox = FakeSandbox(pass_rate=0.5, verdicts=["PASSED", failed])
        assert await score(ANSWER, TESTS, sandbox) == 0.5


@pytest.mark.parametrize("timeout", ["TIMEOUT", 5])
async def test_a_timeout_on_any_test_scores_the_answer_zero(timeout: Any) -> None:
    # §A.7: code that hits the per-test timeout gets 0, not the share of the other tests
    # it passed: 3 of 4 passed (0.75) and one timed out
    sandbox = FakeSandbox(pass_rate=0.75, verdicts=["PASSED", timeout, "PASSED", "PASSED"])
    assert await score(ANSWER, TESTS * 2, sandbox) == 0.0
    first = FakeSandbox(pass_rate=0.5, verdicts=[timeout, "PASSED"])
    assert await score(ANSWER, TESTS, first) == 0.0


async def test_a_sandbox_failure_outranks_a_timeout() -> None:
    sandbox = FakeSandbox(pass_rate=0.0, verdicts=["TIMEOUT", "SANDBOX_ERROR"])
    with pytest.raises(SandboxFailure):
        await score(ANSWER, TESTS, sandbox)
