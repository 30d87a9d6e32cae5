"""The gRPC service around the jail: health, info, errors, overload, deadlines, shutdown."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from marl.clients import AsyncSandboxClient, SandboxClient
from marl.protocol.v1 import sandbox_pb2, sandbox_pb2_grpc
from tests.support.sandbox import ROOT, SandboxServer

SLEEPER = "import time\ntime.sleep(30)\n"
SLEEP_TEST = [{"stdin": "", "expected_stdout": ""}]
LEAK_CHECK = """
import os
found = 'MARL_SANDBOX_TEST_SECRET' in os.environ
for pid in os.listdir('/proc') if os.path.isdir('/proc') else []:
    try:
        with open(f'/proc/{pid}/environ', 'rb') as f:
            found = found or b'MARL_SANDBOX_TEST_SECRET' in f.read()
    except OSError:
        pass
print('leaked' if found else 'clean')
"""


@pytest.fixture(scope="module")
def small() -> Iterator[SandboxServer]:
    """One job at a time, no queue: the second concurrent job is refused."""
    srv = SandboxServer({"max_concurrency": 1, "max_queue": 0}).start()
    yield srv
    srv.stop()


def test_health_reports_serving_and_tier(server: SandboxServer, machine_tier: str) -> None:
    with grpc.insecure_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for name in ("", "marl.v1.Sandbox", f"marl.v1.Sandbox/isolation={machine_tier}"):
            resp = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING, name


def test_info_names_tier_and_layers(client: SandboxClient, machine_tier: str) -> None:
    info = client.info()
    assert info["isolation_tier"] == machine_tier
    assert "seccomp" in info["layers"] or machine_tier == "rlimits"
    assert info["not_protected"]


@pytest.mark.parametrize(("request_", "field"), [
    (sandbox_pb2.ExecuteRequest(code="x"), "tests"),
    (sandbox_pb2.ExecuteRequest(tests=[sandbox_pb2.Test()]), "tests[0]"),
    (sandbox_pb2.ExecuteRequest(tests=[sandbox_pb2.Test(function_call=sandbox_pb2.FunctionCallTest(
        fn_name="f", args_json="[1,", expected_json="1"))]), "tests[0].function_call.args_json"),
    (sandbox_pb2.ExecuteRequest(tests=[sandbox_pb2.Test(function_call=sandbox_pb2.FunctionCallTest(
        fn_name="not a name", args_json="[]", expected_json="1"))]),
     "tests[0].function_call.fn_name"),
    (sandbox_pb2.ExecuteRequest(tests=[sandbox_pb2.Test(assert_program=sandbox_pb2.AssertProgramTest(
        assert_program="assert True", entry_point="f"))]),
     "tests[0].assert_program.assert_program"),
    (sandbox_pb2.ExecuteRequest(tests=[sandbox_pb2.Test(stdio=sandbox_pb2.StdioTest())],
                                limits=sandbox_pb2.Limits(timeout_seconds=1e6)),
     "limits.timeout_seconds"),
    (sandbox_pb2.ExecuteRequest(tests=[sandbox_pb2.Test(stdio=sandbox_pb2.StdioTest())],
                                limits=sandbox_pb2.Limits(memory_bytes=-1)),
     "limits.memory_bytes"),
])
def test_invalid_argument_names_the_field(server: SandboxServer,
                                          request_: sandbox_pb2.ExecuteRequest,
                                          field: str) -> None:
    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            sandbox_pb2_grpc.SandboxStub(channel).Execute(request_, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field + ":"), err.value.details()


def test_client_refuses_malformed_tests() -> None:
    client = SandboxClient("127.0.0.1:1")
    with pytest.raises(ValueError, match=r"tests\[1\]"):
        client.execute("x", [{"stdin": "", "expected_stdout": ""}, {"stdin": ""}])
    with pytest.raises(ValueError, match="limits"):
        client.execute("x", [{"stdin": "", "expected_stdout": ""}], limits={"cpu": 1})
    client.close()


def test_overload_is_refused_fast(small: SandboxServer) -> None:
    errors: list[grpc.RpcError] = []

    def occupy() -> None:
        with SandboxClient(small.address) as c:
            try:
                c.execute(SLEEPER, SLEEP_TEST, limits={"timeout_seconds": 2})
            except grpc.RpcError as e:
                errors.append(e)

    first = threading.Thread(target=occupy)
    first.start()
    time.sleep(0.5)
    with SandboxClient(small.address) as c:
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            c.execute("print(1)", [{"stdin": "", "expected_stdout": "1"}], busy_wait_s=0)
        took = time.monotonic() - start
    first.join()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert took < 1.0
    assert not errors
    assert small.leftovers() == ([], [])


def test_client_waits_out_a_full_server(small: SandboxServer) -> None:
    """By default the client asks a full server again until a slot frees."""
    occupied = threading.Event()

    def occupy() -> None:
        with SandboxClient(small.address) as c:
            occupied.set()
            c.execute(SLEEPER, SLEEP_TEST, limits={"timeout_seconds": 2})

    first = threading.Thread(target=occupy)
    first.start()
    occupied.wait()
    time.sleep(0.5)
    with SandboxClient(small.address) as c:
        start = time.monotonic()
        result = c.execute("print(1)", [{"stdin": "", "expected_stdout": "1"}])
        took = time.monotonic() - start
    first.join()
    assert result.verdicts == ["PASSED"]
    assert took > 0.5  # it waited for the sleeper's slot
    assert small.leftovers() == ([], [])


def test_client_deadline_kills_the_job_within_a_second(server: SandboxServer) -> None:
    """The server fits the job into the client's deadline and kills it when it runs out."""
    with SandboxClient(server.address) as c:
        start = time.monotonic()
        try:
            r = c.execute(SLEEPER, SLEEP_TEST, limits={"timeout_seconds": 20}, timeout=1.0)
            assert r.verdicts == ["TIMEOUT"]
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert server.leftovers(timeout=1.0) == ([], [])
    assert time.monotonic() - start <= 3.0


def test_cancelled_call_kills_the_job_within_a_second(server: SandboxServer) -> None:
    async def go() -> float:
        async with AsyncSandboxClient(server.address) as c:
            call = asyncio.ensure_future(
                c.execute(SLEEPER, SLEEP_TEST, limits={"timeout_seconds": 20}))
            await asyncio.sleep(0.7)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            return time.monotonic()

    cancelled_at = asyncio.run(go())
    assert server.leftovers(timeout=1.0) == ([], [])
    assert time.monotonic() - cancelled_at <= 1.05


def test_async_client_executes(server: SandboxServer) -> None:
    async def go() -> list[str]:
        async with AsyncSandboxClient(server.address) as c:
            results = await asyncio.gather(*[
                c.execute("def sq(x):\n    return x * x\n",
                          [{"fn_name": "sq", "args": [i], "expected": i * i}])
                for i in range(6)])
        return [v for r in results for v in r.verdicts]

    assert asyncio.run(go()) == ["PASSED"] * 6


@pytest.mark.parametrize("tier", ["seccomp", "rlimits"])
def test_lower_tiers_still_judge_and_clean_up(tier: str) -> None:
    srv = SandboxServer({"isolation": tier}).start()
    try:
        with SandboxClient(srv.address) as c:
            assert c.info()["isolation_tier"] == tier
            r = c.execute("import os\nopen('f', 'w').write('x')\nprint(os.listdir('.'))\n"
                          "def add(a, b):\n    return a + b\n",
                          [{"stdin": "", "expected_stdout": "['f']"},
                           {"assert_program": "def check(c):\n    assert c(1, 2) == 3\n",
                            "entry_point": "add"},
                           {"fn_name": "add", "args": [1, 1], "expected": 3}])
            assert r.verdicts == ["PASSED", "PASSED", "FAILED"]
            leak = c.execute(LEAK_CHECK, [{"stdin": "", "expected_stdout": "clean"}])
            assert leak.verdicts == ["PASSED"], leak
            assert r.isolation_tier == tier
        assert srv.leftovers() == ([], [])
    finally:
        srv.stop()


def test_sigterm_stops_the_server_and_its_jobs() -> None:
    srv = SandboxServer({}).start()
    assert srv.proc is not None
    worker = threading.Thread(target=lambda: _ignore_errors(srv.address), daemon=True)
    worker.start()
    time.sleep(0.7)
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(timeout=15) == 0
    deadline = time.monotonic() + 3
    while srv.pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.pids() == []
    srv.stop()


def _ignore_errors(address: str) -> None:
    with SandboxClient(address) as c:
        try:
            c.execute(SLEEPER, SLEEP_TEST, limits={"timeout_seconds": 20})
        except grpc.RpcError:
            pass


def test_bad_config_is_a_user_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_concurrency: 0\n")
    out = subprocess.run([sys.executable, "-m", "services.reward_sandbox.server", "--config",
                          str(bad)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "max_concurrency" in out.stdout


def test_server_survives_its_zygote_dying() -> None:
    srv = SandboxServer({}).start()
    try:
        assert srv.proc is not None
        zygote = [p for p in srv.pids() if _ppid(p) == srv.proc.pid]
        assert len(zygote) == 1
        os.kill(zygote[0], signal.SIGKILL)
        time.sleep(0.5)
        with SandboxClient(srv.address) as c:
            verdicts: list[str] = []
            for _ in range(3):
                try:
                    r = c.execute("print(2)", [{"stdin": "", "expected_stdout": "2"}])
                    verdicts = r.verdicts
                    break
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.UNAVAILABLE
            assert verdicts == ["PASSED"]
    finally:
        srv.stop()


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_calls_cancelled_at_any_moment_leave_nothing(server: SandboxServer) -> None:
    async def go() -> None:
        async with AsyncSandboxClient(server.address) as c:
            for i in range(16):
                call = asyncio.ensure_future(
                    c.execute(SLEEPER, SLEEP_TEST, limits={"timeout_seconds": 20}))
                await asyncio.sleep(0.005 * i)
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call

    asyncio.run(go())
    assert server.leftovers(timeout=2.0) == ([], [])
