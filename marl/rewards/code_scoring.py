"""Code reward (paper §A.7): the final answer's last fenced Python block, run in the sandbox.

The reward is the fraction of the problem's tests that pass. No code block, or a
block that does not compile, gives 0 (a syntax error is caught here before a
sandbox round trip is spent on it); so does an answer that hits the per-test
timeout on ANY test, whatever the others did (§A.7: code that "hits the per-test
execution timeout receives a reward of 0"). Any other failed test (wrong output,
a crash, the memory or output limit) only lowers the pass rate. Nothing here runs
the code: `compile` only parses it. A SANDBOX_ERROR verdict is the sandbox failing,
not the answer: it raises `SandboxFailure` rather than teach the policy a false 0.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, Protocol

from marl.protocol.v1 import sandbox_pb2

PYTHON_TAGS = frozenset({"", "python", "py", "python3", "py3"})
"""Fence info strings taken as Python; a block tagged `text` or `bash` is skipped."""

_OPEN = re.compile(r"^ {0,3}(`{3,})[ \t]*([^`\s]*)[^`]*$")


class ExecuteResult(Protocol):
    @property
    def pass_rate(self) -> float: ...

    @property
    def verdicts(self) -> Iterable[Any]:
        """One per test: a verdict name ("PASSED", ...) or the `marl.v1.Verdict` number."""
        ...


class SandboxFailure(RuntimeError):
    """The sandbox could not run the tests; the episode has no reward and should be retried."""


class SandboxExecutor(Protocol):
    """What `marl.clients.sandbox.AsyncSandboxClient` offers; tests pass a fake."""

    async def execute(
        self, code: str, tests: list[dict[str, Any]], limits: Any = None
    ) -> ExecuteResult: ...


def python_blocks(text: str) -> list[str]:
    """Every closed fenced block whose info string is Python (or empty), in order.

    A fence is three or more backticks at the start of a line (up to three spaces
    in); it closes at a line of at least as many backticks, or at a line that ends
    with them (`print(x)```), a slip models make. An unclosed block is dropped: a
    truncated answer gave no final code.
    """
    blocks = []
    fence: str | None = None
    tag = ""
    body: list[str] = []
    for line in text.splitlines():
        if fence is None:
            m = _OPEN.match(line)
            if m:
                fence, tag, body = m.group(1), m.group(2).lower(), []
            continue
        stripped = line.strip()
        if stripped.startswith(fence) and not stripped.strip("`"):
            closed = True
        elif line.rstrip().endswith(fence):
            body.append(line.rstrip()[: -len(fence)])
            closed = True
        else:
            body.append(line)
            closed = False
        if closed:
            if tag in PYTHON_TAGS:
                blocks.append("\n".join(body).strip("\n"))
            fence = None
    return blocks


def extract_code(response: str) -> str | None:
    """The last fenced Python block of the answer, or None when there is none."""
    blocks = [b for b in python_blocks(response) if b.strip()]
    return blocks[-1] if blocks else None


def compiles(code: str) -> bool:
    """True when `code` is valid Python syntax (parsed, never executed)."""
    try:
        compile(code, "<answer>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return False
    return True


async def score(response: str, tests: list[dict[str, Any]], client: SandboxExecutor) -> float:
    """Fraction of `tests` the answer's last Python block passes; 0 without runnable code
    or when any test timed out."""
    if not tests:
        raise ValueError(
            "a code problem needs at least one test; the data loader should "
            "have refused this problem"
        )
    code = extract_code(response)
    if code is None or not compiles(code):
        return 0.0
    result = await client.execute(code, tests, limits=None)
    verdicts = list(result.verdicts)
    if any(v in ("SANDBOX_ERROR", sandbox_pb2.SANDBOX_ERROR) for v in verdicts):
        raise SandboxFailure("the sandbox reported SANDBOX_ERROR; see its log")
    if any(v in ("TIMEOUT", sandbox_pb2.TIMEOUT) for v in verdicts):
        return 0.0
    return min(1.0, max(0.0, float(result.pass_rate)))
