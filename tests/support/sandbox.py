"""A real sandbox server as a subprocess, and helpers the sandbox tests share.

The server runs on a free loopback port (health-checked), with a scratch root
and a secret environment variable of its own. `leftovers()` waits until the
server is back to its idle set of processes (zygote plus warm jails) and its
scratch root is empty, and reports anything beyond that.

MARL_SANDBOX_SABOTAGE=1 in the environment is passed on to the server (see
scripts/check_sandbox_sabotage.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from marl.clients import AsyncSandboxClient
from marl.clients.sandbox import ExecuteResult
from marl.runtime.processes import free_port
from marl.runtime.serving import wait_healthy
from services.reward_sandbox.forkserver_client import MARKER

ROOT = Path(__file__).resolve().parents[2]
SECRET_ENV = "MARL_SANDBOX_TEST_SECRET"
DEADLINE = 12.0



def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []


class SandboxServer:
    def __init__(self, config: dict[str, Any]):
        self.tmp = Path(tempfile.mkdtemp(prefix="marl-sandbox-test-"))
        self.tmp.chmod(0o711)  # below the namespaces tier jobs run as uid 65534 when root
        self.scratch = self.tmp / "scratch"
        self.secret = "secret-" + uuid.uuid4().hex
        self.config = {"scratch_root": str(self.scratch), "max_concurrency": 4,
                       "warm_jails": 2, **config}
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.idle = 0

    def start(self) -> SandboxServer:
        path = self.tmp / "sandbox.yaml"
        path.write_text(json.dumps(self.config))
        env = {**os.environ, SECRET_ENV: self.secret}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.reward_sandbox.server", "--port", str(self.port),
             "--config", str(path)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
            stderr=open(self.tmp / "server.log", "wb"))
        asyncio.run(wait_healthy(self.address, timeout=60))
        self.idle = self._settle_count()
        return self

    def pids(self) -> list[int]:
        """Live processes of this server's zygote, its jails and whatever they forked."""
        assert self.proc is not None
        me = str(self.proc.pid)
        out = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                argv = cmdline(int(entry))
                if MARKER in argv and me in argv:
                    out.append(int(entry))
        return out

    def _settle_count(self, timeout: float = 10.0) -> int:
        last, since = -1, time.monotonic()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            n = len(self.pids())
            if n != last:
                last, since = n, time.monotonic()
            elif time.monotonic() - since > 0.5:
                return n
            time.sleep(0.05)
        return last

    def leftovers(self, timeout: float = 10.0) -> tuple[list[int], list[str]]:
        """Processes beyond the idle set and files in the scratch root, after settling (jails
        killed by a cancel take seconds to be reaped when the suite loads both cores)."""
        deadline = time.monotonic() + timeout
        while True:
            pids = self.pids()
            files = sorted(os.listdir(self.scratch)) if self.scratch.exists() else []
            if (len(pids) <= self.idle and not files) or time.monotonic() > deadline:
                extra = pids if len(pids) > self.idle else []
                return extra, files
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None:
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        subprocess.run(["rm", "-rf", str(self.tmp)], check=False)


BENIGN_CODE = "import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))\n"
BENIGN_TESTS = [{"stdin": "1 2 3\n", "expected_stdout": "6\n"}]
DENY_LIMITS = {"timeout_seconds": 2.0, "memory_bytes": 256 << 20, "output_bytes": 64 << 10}


def run_alongside(server: SandboxServer, code: str, tests: list[dict[str, Any]],
                  limits: dict[str, Any] | None = None,
                  deadline: float = DEADLINE) -> tuple[ExecuteResult, float]:
    """Run a job with a benign job beside it; assert the benign one passed.

    Returns the job's result and its wall time in seconds.
    """

    async def go() -> tuple[ExecuteResult, float, ExecuteResult]:
        async with AsyncSandboxClient(server.address) as c:
            start = time.monotonic()

            async def timed() -> tuple[ExecuteResult, float]:
                r = await c.execute(code, tests, limits or DENY_LIMITS, timeout=deadline)
                return r, time.monotonic() - start

            (result, took), benign = await asyncio.gather(
                timed(), c.execute(BENIGN_CODE, BENIGN_TESTS, timeout=deadline))
            return result, took, benign

    result, took, benign = asyncio.run(go())
    assert benign.verdicts == ["PASSED"], f"benign job alongside failed: {benign}"
    return result, took
