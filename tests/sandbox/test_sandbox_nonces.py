"""Per-test nonces: no candidate can find the nonce of a record still to be written.

The harness forks the candidates of a job without assert programs itself, and
reads test i's nonce only after test i ran. These tests run the executor in
this process with nonces they choose, against a real zygote and jails, and
have every candidate list each 32-hex-digit string it can reach (live objects,
the stack it was forked with). The server side counts only the first record
per test, and only with that test's own nonce.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from marl.clients.sandbox import build_request
from marl.spec.services import SandboxConfig
from services.reward_sandbox import executor as executor_module
from services.reward_sandbox import jobspec, wire
from services.reward_sandbox.executor import Executor, JobResult
from services.reward_sandbox.forkserver_client import ZygoteClient
from services.reward_sandbox.server import zygote_config

FIND = r"""
import gc, re, sys
HEX = re.compile(r'[0-9a-f]{32}')
def found():
    seen = set()
    def scan(value):
        if isinstance(value, str):
            seen.update(HEX.findall(value))
        elif isinstance(value, (bytes, bytearray, memoryview)):
            seen.update(m.decode() for m in re.findall(rb'[0-9a-f]{32}', bytes(value)))
    for obj in gc.get_objects():
        if isinstance(obj, dict):
            values = [*obj.keys(), *obj.values()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            values = obj
        else:
            values = getattr(getattr(obj, '__code__', None), 'co_consts', ())
        for value in values:
            scan(value)
    frame = sys._getframe()
    while frame is not None:
        for value in frame.f_locals.values():
            scan(value)
            if isinstance(value, (dict, list, tuple)):
                for inner in (value.values() if isinstance(value, dict) else value):
                    scan(inner)
            for attr in getattr(value, '__dict__', {}).values():
                scan(attr)
        frame = frame.f_back
    return ' '.join(sorted(seen))
"""


def _nonces(count: int) -> list[str]:
    return [f"{i:02x}" + "c0ffee" * 5 for i in range(count)]


def run_job(code: str, tests: list[dict[str, Any]], nonces: list[str],
            monkeypatch: pytest.MonkeyPatch) -> JobResult:
    supply: Iterator[str] = iter(nonces)
    monkeypatch.setattr(executor_module.secrets, "token_hex", lambda _n: next(supply))
    cfg = SandboxConfig(max_concurrency=1, warm_jails=1)
    job = jobspec.parse(build_request(code, tests, {"timeout_seconds": 10}), cfg)

    async def go() -> JobResult:
        zygote = ZygoteClient(zygote_config(cfg, sabotage=False))
        report = await zygote.start()
        try:
            with tempfile.TemporaryDirectory() as scratch:
                os.chmod(scratch, 0o711)
                executor = Executor(zygote, report["tier"], scratch, cfg.job_overhead_seconds)
                return await executor.run(job, None)
        finally:
            zygote.close()

    return asyncio.run(go())


def test_a_fresh_candidate_per_test_finds_no_nonce_still_to_be_used(
        monkeypatch: pytest.MonkeyPatch) -> None:
    nonces = _nonces(4)  # three stdio tests, then the done record
    code = FIND + "print(found())\n"
    tests = [{"stdin": "", "expected_stdout": "x"} for _ in range(3)]
    result = run_job(code, tests, nonces, monkeypatch)
    assert result.tier != "none"
    assert [r.verdict for r in result.results] == ["FAILED"] * 3
    for i, r in enumerate(result.results):
        found = set(r.stdout.split())
        assert not found & set(nonces[i:]), (i, found)


def test_a_serving_candidate_finds_no_nonce(monkeypatch: pytest.MonkeyPatch) -> None:
    nonces = _nonces(4)
    code = FIND + "def f():\n    print(found())\n    return 1\n"
    tests = [{"fn_name": "f", "args": [], "expected": 1} for _ in range(3)]
    result = run_job(code, tests, nonces, monkeypatch)
    assert [r.verdict for r in result.results] == ["PASSED"] * 3
    for r in result.results:
        assert not set(r.stdout.split()) & set(nonces), r.stdout


def test_candidates_of_assert_programs_find_no_nonce(monkeypatch: pytest.MonkeyPatch) -> None:
    nonces = _nonces(3)
    code = FIND + "def f():\n    print(found())\n    return 1\n"
    program = "def check(candidate):\n    assert candidate() == 1\n"
    tests = [{"assert_program": program, "entry_point": "f"} for _ in range(2)]
    result = run_job(code, tests, nonces, monkeypatch)
    assert [r.verdict for r in result.results] == ["PASSED"] * 2
    for r in result.results:
        assert not set(r.stdout.split()) & set(nonces), r.stdout


def _frames(records: list[dict[str, Any]]) -> bytes:
    return b"".join(wire.encode_frame(r) for r in records)


def test_only_the_first_record_with_its_own_nonce_counts() -> None:
    nonces = _nonces(3)
    frames = _frames([
        {"nonce": nonces[1], "test": 0, "outcome": "ok", "stdout": "wrong nonce"},
        {"nonce": nonces[0], "test": 0, "outcome": "ok", "stdout": "first"},
        {"nonce": nonces[0], "test": 0, "outcome": "ok", "stdout": "second"},
        {"nonce": nonces[1], "test": 5, "outcome": "ok"},
        {"nonce": nonces[0], "done": True},
        {"nonce": nonces[1], "test": 1, "outcome": "ok", "stdout": "one"},
        {"nonce": nonces[2], "done": True},
        {"nonce": nonces[1], "test": 1, "outcome": "ok", "stdout": "after done"},
    ])
    read_fd, write_fd = os.pipe()
    os.write(write_fd, frames)
    records: dict[int, dict[str, Any]] = {}
    executor = Executor(ZygoteClient({}), "namespaces", tempfile.gettempdir(), 1.0)
    try:
        fatal = asyncio.run(executor._collect(read_fd, nonces, 1 << 20, records))
    finally:
        os.close(read_fd)
        os.close(write_fd)
    assert fatal == ""
    assert {i: r["stdout"] for i, r in records.items()} == {0: "first", 1: "one"}


def test_nonces_are_read_one_fixed_width_slot_at_a_time() -> None:
    nonces = _nonces(3)
    fd = os.memfd_create("nonces", 0)
    try:
        os.write(fd, "".join(nonces).encode())
        reader = wire.Nonces(fd)
        assert [reader.read(i) for i in (2, 0, 1, 2)] == [nonces[2], *nonces]
    finally:
        os.close(fd)
