"""Clients for the reward sandbox (`marl serve sandbox`), sync and asyncio.

    from marl.clients import SandboxClient

    with SandboxClient("127.0.0.1:50061") as sandbox:
        result = sandbox.execute("print(int(input()) * 2)",
                                 [{"stdin": "21\\n", "expected_stdout": "42\\n"}])
    result.pass_rate   # 1.0
    result.verdicts    # ["PASSED"]

A test is one of three dicts:

- `{"stdin": str, "expected_stdout": str}`: run the code as a script;
- `{"fn_name": str, "args": list, "expected": any}`: call a top-level function
  (or a method of class `Solution`) with JSON arguments, compare the JSON result;
- `{"assert_program": str, "entry_point": str}`: HumanEval form, the program
  defines `check(candidate)` and is called with the function `entry_point`.

`limits` is None (server defaults) or a dict with any of `timeout_seconds`
(per test, wall clock), `memory_bytes` and `output_bytes`. Every call has a
deadline: `timeout` seconds, or by default the tests' time limits plus a
margin. A malformed test raises ValueError here; server-side errors raise
grpc.RpcError (INVALID_ARGUMENT names the field). A full server (RESOURCE_EXHAUSTED)
is asked again with backoff for up to `busy_wait_s` (120 s); a server stopping or
restarting is waited for and the call retried within its deadline (DEADLINE_EXCEEDED
when none came back). Calls carry the sandbox's own token when `$MARL_SANDBOX_TOKEN` (or
`$MARL_SANDBOX_TOKEN_FILE`) is set, never the services' token.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from marl.protocol.rpc_codes import SERVER_GONE
from marl.protocol.v1 import sandbox_pb2, sandbox_pb2_grpc
from marl.runtime import auth
from marl.spec.services import SANDBOX_TEST_TIMEOUT_S, sandbox_token

BUSY_WAIT_S = 120.0
"""How long a call keeps asking a full sandbox (RESOURCE_EXHAUSTED) before it gives up."""
_MARGIN_SECONDS = 15.0
_RETRY = {
    "methodConfig": [{
        "name": [{"service": "marl.v1.Sandbox"}],
        "waitForReady": True,
        "retryPolicy": {
            "maxAttempts": 5,
            "initialBackoff": "0.5s",
            "maxBackoff": "4s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": [code.name for code in SERVER_GONE],
        },
    }]
}
"""Running tests on code has no side effects, so a call that found the server stopping
(`SERVER_GONE`) is sent again with jittered backoff, and a call made while no server
answers (one restarting) waits for it: both within the call's deadline."""
_OPTIONS = [("grpc.max_receive_message_length", 64 << 20),
            ("grpc.max_send_message_length", 64 << 20),
            ("grpc.enable_retries", 1),
            ("grpc.service_config", json.dumps(_RETRY))]
_LIMIT_FIELDS = ("timeout_seconds", "memory_bytes", "output_bytes")


def _busy_delays(busy_wait_s: float) -> Iterator[float | None]:
    """Pauses before asking a full server again (jittered, doubling to 2 s) while they fit
    in `busy_wait_s`, then None: give up."""
    give_up = time.monotonic() + busy_wait_s
    backoff = 0.1
    while time.monotonic() + backoff <= give_up:
        yield backoff * (0.5 + random.random())
        backoff = min(backoff * 2, 2.0)
    yield None


@dataclass
class TestResult:
    verdict: str
    stdout: str
    stderr: str
    seconds: float
    error: str


@dataclass
class ExecuteResult:
    pass_rate: float
    verdicts: list[str]
    results: list[TestResult] = field(default_factory=list)
    isolation_tier: str = ""


def _test(i: int, test: dict[str, Any]) -> sandbox_pb2.Test:
    if not isinstance(test, dict):
        raise ValueError(f"tests[{i}]: must be a dict, got {type(test).__name__}")
    keys = set(test)
    if keys == {"stdin", "expected_stdout"}:
        return sandbox_pb2.Test(stdio=sandbox_pb2.StdioTest(
            stdin=str(test["stdin"]), expected_stdout=str(test["expected_stdout"])))
    if keys == {"fn_name", "args", "expected"}:
        if not isinstance(test["args"], list | tuple):
            raise ValueError(f"tests[{i}].args: must be a list of positional arguments")
        try:
            args, expected = json.dumps(list(test["args"])), json.dumps(test["expected"])
        except (TypeError, ValueError) as e:
            raise ValueError(f"tests[{i}]: args and expected must be JSON values ({e})") from None
        return sandbox_pb2.Test(function_call=sandbox_pb2.FunctionCallTest(
            fn_name=str(test["fn_name"]), args_json=args, expected_json=expected))
    if keys == {"assert_program", "entry_point"}:
        return sandbox_pb2.Test(assert_program=sandbox_pb2.AssertProgramTest(
            assert_program=str(test["assert_program"]), entry_point=str(test["entry_point"])))
    raise ValueError(f"tests[{i}]: keys {sorted(keys)} are none of {{stdin, expected_stdout}}, "
                     "{fn_name, args, expected}, {assert_program, entry_point}")


def build_request(code: str, tests: list[dict[str, Any]],
                  limits: dict[str, Any] | None = None) -> sandbox_pb2.ExecuteRequest:
    """The ExecuteRequest for `execute`; raises ValueError naming a malformed test."""
    limits = dict(limits or {})
    unknown = set(limits) - set(_LIMIT_FIELDS)
    if unknown:
        raise ValueError(f"limits: unknown keys {sorted(unknown)}; use {list(_LIMIT_FIELDS)}")
    return sandbox_pb2.ExecuteRequest(
        code=code, tests=[_test(i, t) for i, t in enumerate(tests)],
        limits=sandbox_pb2.Limits(**limits))


def default_deadline(request: sandbox_pb2.ExecuteRequest) -> float:
    per_test = request.limits.timeout_seconds or SANDBOX_TEST_TIMEOUT_S
    return len(request.tests) * (per_test + 0.5) + _MARGIN_SECONDS


def to_result(resp: sandbox_pb2.ExecuteResponse) -> ExecuteResult:
    results = [TestResult(sandbox_pb2.Verdict.Name(r.verdict), r.stdout, r.stderr, r.seconds,
                          r.error) for r in resp.results]
    return ExecuteResult(resp.pass_rate, [r.verdict for r in results], results,
                         resp.isolation_tier)


def _info(resp: sandbox_pb2.InfoResponse) -> dict[str, Any]:
    return {"isolation_tier": resp.isolation_tier,
            "layers": {layer.name: layer.protects for layer in resp.layers},
            "not_protected": list(resp.not_protected), "probes": dict(resp.probes)}


class SandboxClient:
    """Blocking client; one channel, safe to share between threads."""

    def __init__(self, address: str):
        self.address = address
        self.channel = auth.channel(address, options=_OPTIONS, token_from=sandbox_token)
        self.stub = sandbox_pb2_grpc.SandboxStub(self.channel)

    def execute(self, code: str, tests: list[dict[str, Any]],
                limits: dict[str, Any] | None = None,
                timeout: float | None = None,
                busy_wait_s: float = BUSY_WAIT_S) -> ExecuteResult:
        """Run `tests` on `code`; a server that is full (RESOURCE_EXHAUSTED) is asked again
        with jittered backoff for up to `busy_wait_s` seconds before its error is raised."""
        request = build_request(code, tests, limits)
        for delay in _busy_delays(busy_wait_s):
            try:
                resp = self.stub.Execute(request, timeout=timeout or default_deadline(request))
                return to_result(resp)
            except grpc.RpcError as err:
                code_ = err.code()  # type: ignore[attr-defined]
                if code_ != grpc.StatusCode.RESOURCE_EXHAUSTED or delay is None:
                    raise
            time.sleep(delay)
        raise AssertionError("unreachable: the last delay is None")

    def info(self, timeout: float = 10.0) -> dict[str, Any]:
        return _info(self.stub.Info(sandbox_pb2.InfoRequest(), timeout=timeout))

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> SandboxClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncSandboxClient:
    """asyncio client (grpc.aio); create it inside the event loop that uses it."""

    def __init__(self, address: str):
        self.address = address
        self.channel = auth.aio_channel(address, options=_OPTIONS, token_from=sandbox_token)
        self.stub = sandbox_pb2_grpc.SandboxStub(self.channel)

    async def execute(self, code: str, tests: list[dict[str, Any]],
                      limits: dict[str, Any] | None = None,
                      timeout: float | None = None,
                      busy_wait_s: float = BUSY_WAIT_S) -> ExecuteResult:
        """Run `tests` on `code`; a server that is full (RESOURCE_EXHAUSTED) is asked again
        with jittered backoff for up to `busy_wait_s` seconds before its error is raised."""
        request = build_request(code, tests, limits)
        for delay in _busy_delays(busy_wait_s):
            try:
                resp = await self.stub.Execute(
                    request, timeout=timeout or default_deadline(request)
                )
                return to_result(resp)
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or delay is None:
                    raise
            await asyncio.sleep(delay)
        raise AssertionError("unreachable: the last delay is None")

    async def info(self, timeout: float = 10.0) -> dict[str, Any]:
        return _info(await self.stub.Info(sandbox_pb2.InfoRequest(), timeout=timeout))

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncSandboxClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
