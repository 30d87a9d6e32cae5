"""The sandbox's SandboxFusion endpoint, driven by SandboxFusion's own client from PyPI.

One real `services.reward_sandbox.server` process with `--http-port`; every
call goes through `sandbox_fusion.run_code` (one attempt, so a refusal is
seen, not retried). The server takes one job at a time and queues none, so
the overload test can fill it with one sleeping job.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import requests
from sandbox_fusion import RunCodeRequest, RunCodeResponse, run_code

from marl.clients import SandboxClient
from marl.runtime.processes import free_port
from marl.runtime.serving import wait_healthy

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Server:
    grpc_address: str
    url: str
    tier: str


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("sandbox-http")
    tmp.chmod(0o711)
    config = tmp / "sandbox.yaml"
    config.write_text(json.dumps({"max_concurrency": 1, "max_queue": 0, "warm_jails": 2,
                                  "max_timeout_seconds": 20,
                                  "scratch_root": str(tmp / "scratch")}))
    port, http_port = free_port(), free_port()
    log = open(tmp / "server.log", "w+b")
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.reward_sandbox.server", "--port", str(port),
         "--http-port", str(http_port), "--config", str(config)],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        asyncio.run(wait_healthy(f"127.0.0.1:{port}", timeout=60))
        with SandboxClient(f"127.0.0.1:{port}") as c:
            tier = str(c.info()["isolation_tier"])
        yield Server(f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}", tier)
    finally:
        proc.terminate()
        proc.wait(15)
        log.seek(0)
        print(log.read().decode(errors="replace")[-3000:])


def run(server: Server, code: str, **fields: Any) -> RunCodeResponse:
    return run_code(RunCodeRequest(code=code, language="python", **fields),
                    endpoint=server.url, max_attempts=1)


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def test_allow_print(server: Server) -> None:
    resp = run(server, "print('hello from marl')")
    assert resp.status == "Success"
    assert resp.run_result is not None
    assert resp.run_result.status == "Finished"
    assert resp.run_result.return_code == 0
    assert resp.run_result.stdout == "hello from marl\n"
    assert resp.run_result.stderr == ""
    assert resp.run_result.execution_time is not None and resp.run_result.execution_time < 5


def test_allow_stdin(server: Server) -> None:
    code = "a, b = map(int, input().split())\nprint(a * b)\nimport sys\nprint(sys.stdin.read().upper(), end='')"
    resp = run(server, code, stdin="6 7\nrest of it\n")
    assert resp.run_result is not None
    assert resp.run_result.stdout == "42\nREST OF IT\n"


def test_allow_main_guard(server: Server) -> None:
    resp = run(server, "if __name__ == '__main__':\n    print(__name__)")
    assert resp.run_result is not None and resp.run_result.stdout == "__main__\n"


def test_nonzero_exit(server: Server) -> None:
    resp = run(server, "import sys\nprint('partial')\nsys.exit(3)")
    assert resp.status == "Failed"
    assert resp.run_result is not None
    assert resp.run_result.status == "Finished"
    assert resp.run_result.return_code == 3
    assert resp.run_result.stdout == "partial\n"

    resp = run(server, "x = 1\nprint(x / 0)")
    assert resp.run_result is not None and resp.run_result.return_code == 1
    stderr = resp.run_result.stderr or ""
    assert 'File "main.py", line 2' in stderr and "ZeroDivisionError" in stderr
    assert "print(x / 0)" in stderr  # the source line, as python shows it for a file

    resp = run(server, "def f(:\n    pass")
    assert resp.run_result is not None and resp.run_result.return_code == 1
    assert "SyntaxError" in (resp.run_result.stderr or "")


def test_timeout(server: Server) -> None:
    started = time.monotonic()
    resp = run(server, "print('started', flush=True)\nwhile True:\n    pass", run_timeout=1)
    assert time.monotonic() - started < 8
    assert resp.status == "Failed"
    assert resp.run_result is not None
    assert resp.run_result.status == "TimeLimitExceeded"
    assert resp.run_result.stdout == "started\n"


def test_files_written_by_request_and_fetched_back(server: Server) -> None:
    code = """
import os
with open('data/numbers.txt') as f:
    total = sum(int(line) for line in f)
os.makedirs('out', exist_ok=True)
with open('out/total.txt', 'w') as f:
    f.write(str(total))
with open('raw.bin', 'wb') as f:
    f.write(bytes(range(256)))
print(total)
"""
    resp = run(server, code, files={"data/numbers.txt": b64("1\n2\n39\n")},
               fetch_files=["out/total.txt", "raw.bin", "never-written.txt"])
    assert resp.status == "Success", resp
    assert resp.run_result is not None and resp.run_result.stdout == "42\n"
    assert set(resp.files) == {"out/total.txt", "raw.bin"}
    assert base64.b64decode(resp.files["out/total.txt"]) == b"42"
    assert base64.b64decode(resp.files["raw.bin"]) == bytes(range(256))


def test_deny_files_surviving_into_the_next_request(server: Server) -> None:
    first = run(server, "open('left.txt', 'w').write('from the first job')",
                files={"given.txt": b64("given")})
    assert first.status == "Success"
    second = run(server, "import os\nprint(sorted(os.listdir('.')))",
                 fetch_files=["left.txt", "given.txt"])
    assert second.files == {}
    assert second.run_result is not None
    assert "left.txt" not in (second.run_result.stdout or "")
    assert "given.txt" not in (second.run_result.stdout or "")


class Listener:
    """A TCP listener on loopback that records whatever connects to it."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.hits: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, addr = self.sock.accept()
            except TimeoutError:
                continue
            self.hits.append(str(addr))
            conn.close()

    def close(self) -> list[str]:
        time.sleep(0.3)
        self.stop.set()
        self.thread.join()
        self.sock.close()
        return self.hits


def test_deny_network(server: Server) -> None:
    if server.tier == "rlimits":
        pytest.skip("the rlimits tier leaves the network open (see marl sandbox doctor)")
    listener = Listener()
    code = f"""
import socket
try:
    socket.create_connection(('127.0.0.1', {listener.port}), timeout=1).sendall(b'leak')
    print('connected')
except OSError as e:
    print('denied', type(e).__name__)
"""
    resp = run(server, code)
    assert listener.close() == []
    assert resp.run_result is not None
    assert (resp.run_result.stdout or "").startswith("denied")


def test_deny_host_filesystem(server: Server, tmp_path: Path) -> None:
    if server.tier != "namespaces":
        pytest.skip("below the namespaces tier the sandbox uid may reach host files (doctor)")
    tmp_path.chmod(0o755)
    secret = tmp_path / "secret.txt"
    secret.write_text("the host's secret")
    secret.chmod(0o644)
    planted = tmp_path / "planted.txt"
    code = f"""
for path in ({str(secret)!r}, '/etc/hostname'):
    try:
        print('read', open(path).read())
    except OSError as e:
        print('no read', type(e).__name__)
try:
    open({str(planted)!r}, 'w').write('escaped')
    print('wrote')
except OSError as e:
    print('no write', type(e).__name__)
"""
    resp = run(server, code, fetch_files=[])
    assert resp.run_result is not None
    out = resp.run_result.stdout or ""
    assert "the host's secret" not in out
    assert "wrote" not in out.splitlines()
    assert not planted.exists()


def test_bad_requests_name_the_field(server: Server) -> None:
    def refused(body: dict[str, Any]) -> str:
        reply = requests.post(server.url + "/run_code", json=body, timeout=10)
        assert reply.status_code == 400, reply.text
        return str(reply.json()["message"])

    with pytest.raises(Exception, match="400.*language.*'cpp'"):
        run_code(RunCodeRequest(code="int main(){}", language="cpp"), endpoint=server.url,
                 max_attempts=1)
    assert refused({"code": "print(1)", "language": "python", "run_timeout": 3600}
                   ).startswith("run_timeout:")
    assert refused({"code": "print(1)", "language": "python", "run_timeout": "soon"}
                   ).startswith("run_timeout:")
    assert refused({"code": "print(1)", "language": "python", "files": {"../up.txt": b64("x")}}
                   ).startswith("files['../up.txt']:")
    assert refused({"code": "print(1)", "language": "python", "files": {"a": "not base64!"}}
                   ).startswith("files['a']:")
    assert refused({"code": "print(1)", "language": "python", "fetch_files": ["/etc/passwd"]}
                   ).startswith("fetch_files[0]:")
    assert refused({"language": "python"}).startswith("code:")
    assert refused({"code": "print(1)", "language": "python", "timeout": 3}
                   ).startswith("timeout:")
    reply = requests.post(server.url + "/run_code", data=b"{not json", timeout=10)
    assert reply.status_code == 400 and reply.json()["message"].startswith("body:")


def test_overload_is_429_and_shared_with_grpc(server: Server) -> None:
    """One slot, no queue: while an HTTP job holds it, HTTP gets 429 and gRPC RESOURCE_EXHAUSTED."""
    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(run, server, "import time\ntime.sleep(3)\nprint('done')")
        time.sleep(1.0)
        with pytest.raises(Exception, match="429"):
            run(server, "print('one too many')")
        with SandboxClient(server.grpc_address) as c, pytest.raises(grpc.RpcError) as err:
            c.execute("print(1)", [{"stdin": "", "expected_stdout": "1"}], busy_wait_s=0)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        first = busy.result(timeout=30)
    assert first.run_result is not None and first.run_result.stdout == "done\n"
    assert run(server, "print('free again')").status == "Success"


def test_client_gone_frees_its_slot(server: Server) -> None:
    """A client that hangs up kills its job at once, as a cancelled gRPC call does."""
    with pytest.raises(requests.exceptions.Timeout):
        requests.post(server.url + "/run_code", timeout=1.5, json={
            "code": "import time\ntime.sleep(15)", "language": "python", "run_timeout": 20})
    started = time.monotonic()
    while True:  # the one slot is free again within seconds, not after 15 s
        try:
            assert run(server, "print('next')").status == "Success"
            break
        except Exception as err:
            assert "429" in str(err)
            assert time.monotonic() - started < 5, "the abandoned job still holds the slot"
            time.sleep(0.2)


def test_sandbox_run_cli(server: Server, tmp_path: Path) -> None:
    """`marl sandbox run FILE.py --stdin FILE` against the running server's HTTP endpoint."""
    program = tmp_path / "prog.py"
    program.write_text("import sys\nname = input()\nprint('hi', name)\nsys.exit(4)\n")
    stdin = tmp_path / "in.txt"
    stdin.write_text("marl\n")
    env = {**os.environ, "MARL_SANDBOX_HTTP": server.url}
    out = subprocess.run([sys.executable, "-m", "marl.cli", "sandbox", "run", str(program),
                          "--stdin", str(stdin)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 4, out.stderr
    assert out.stdout == "hi marl\n"
    missing = subprocess.run([sys.executable, "-m", "marl.cli", "sandbox", "run",
                              str(tmp_path / "nope.py")], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "nope.py" in missing.stderr
