"""Adversarial jobs in the seccomp tier (the chart's tier: no user namespaces in a hardened
pod), where every job shares the server's uid: a job reaches nothing but itself.

The server here is started with `isolation: seccomp`. Each attack is bounded and reports
what it achieved; with MARL_SANDBOX_SABOTAGE=1 every test_deny_* here must fail
(scripts/check_sandbox_sabotage.py). Also: `isolation: auto` refuses to start on a host
that allows nothing stronger than rlimits, unless `rlimits` is explicit.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from marl.clients import AsyncSandboxClient
from tests.support.sandbox import DENY_LIMITS, ROOT, SandboxServer, run_alongside


def stdio(code: str) -> tuple[str, list[dict[str, Any]]]:
    return code, [{"stdin": "", "expected_stdout": ""}]


def out(result: Any) -> str:
    return str(result.results[0].stdout)


@pytest.fixture(scope="module")
def _seccomp_server(machine_tier: str) -> Iterator[SandboxServer]:
    if machine_tier == "rlimits":
        pytest.skip("needs the seccomp tier; this machine allows rlimits")
    srv = SandboxServer({"isolation": "seccomp"}).start()
    yield srv
    srv.stop()


@pytest.fixture
def server(_seccomp_server: SandboxServer) -> SandboxServer:
    srv = _seccomp_server
    yield srv  # type: ignore[misc]
    pids, files = srv.leftovers()
    assert not pids and not files, f"left behind: processes {pids}, scratch files {files}"


REACH = """
import os, sys
targets = {targets!r}
reached = []
for name, pid in targets.items():
    for what, call in (
        ("prlimit", lambda: __import__("resource").prlimit(pid, __import__("resource").RLIMIT_NOFILE, (32, 32))),
        ("setpriority", lambda: os.setpriority(os.PRIO_PROCESS, pid, 19)),
        ("sched_setaffinity", lambda: os.sched_setaffinity(pid, {{0}})),
    ):
        try:
            call()
            reached.append(f"{{what}}:{{name}}")
        except OSError:
            pass
print(" ".join(reached) or "none")
"""


def test_deny_prlimit_renice_repin_parent_and_server(server: SandboxServer) -> None:
    assert server.proc is not None
    code = REACH.format(targets={"server": server.proc.pid}).replace(
        "targets = {", "targets = {'parent': os.getppid(), ", 1)
    result, _ = run_alongside(server, *stdio(code))
    assert out(result).strip() == "none", out(result)


def test_deny_prlimit_renice_repin_another_job(server: SandboxServer) -> None:
    """A job sleeps and prints its pid; a second job, told that pid, tries to reach it."""
    marker = uuid.uuid4().hex
    sleeper = f"import os, time\nprint({marker!r}, os.getpid(), flush=True)\ntime.sleep(6)\n"

    def ppid(pid: int) -> int:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            return 0

    def sleeper_pid() -> int | None:
        """A candidate: a process of the server's tree whose parent (a jail) has a parent
        (the zygote) in the tree too."""
        tree = set(server.pids())
        found = [p for p in tree if ppid(p) in tree and ppid(ppid(p)) in tree]
        return max(found) if found else None

    async def go() -> str:
        async with AsyncSandboxClient(server.address) as c:
            sleeping = asyncio.create_task(c.execute(
                sleeper, [{"stdin": "", "expected_stdout": ""}],
                {**DENY_LIMITS, "timeout_seconds": 10.0}, timeout=30))
            deadline = time.monotonic() + 20
            pid = None
            while pid is None:
                assert time.monotonic() < deadline, "the sleeping job never started"
                await asyncio.sleep(0.5)
                pid = sleeper_pid()
            code = REACH.format(targets={"other job": pid})
            attacker = await c.execute(code, [{"stdin": "", "expected_stdout": ""}],
                                       DENY_LIMITS, timeout=30)
            await sleeping
            return out(attacker)

    assert asyncio.run(go()).strip() == "none"


def test_deny_files_left_in_tmp(server: SandboxServer) -> None:
    name = f"marl-deny-{uuid.uuid4().hex}"
    code = f"""
import os, tempfile
left = []
for path in ("/tmp/{name}", os.path.join(tempfile.gettempdir(), "{name}-t"),
             "/var/tmp/{name}", "/dev/shm/{name}"):
    try:
        with open(path, "w") as f:
            f.write("x")
        left.append(path)
    except OSError:
        pass
print(" ".join(left))
"""
    result, _ = run_alongside(server, *stdio(code))
    wrote = out(result).split()
    outside = [p for p in wrote if not p.startswith(str(server.scratch))]
    assert not [p for p in outside if os.path.exists(p)], wrote
    assert not outside, f"the job wrote outside its scratch: {wrote}"


def test_deny_thread_bomb_in_the_seccomp_tier(server: SandboxServer) -> None:
    code = """
import threading
threading.stack_size(32 * 1024)
stop = threading.Event()
made = 0
for _ in range(1500):
    try:
        threading.Thread(target=stop.wait, daemon=True).start()
    except (RuntimeError, MemoryError):
        break
    made += 1
print(made)
stop.set()
"""
    result, _ = run_alongside(server, *stdio(code))
    # max_processes (32 by default) more than the uid ran when the candidate started
    assert 0 <= int(out(result).strip() or "0") <= 32, out(result)


NO_SECCOMP = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {root!r})
    from services.reward_sandbox import seccomp
    t = seccomp._TABLES[seccomp.syscalls.MACHINE]
    rules = seccomp._deny(t["unshare"]) + seccomp._deny(317)  # seccomp(2)
    rules += seccomp._guarded(157, [  # prctl(PR_SET_SECCOMP, ...)
        (seccomp._LD_ABS, 0, 0, seccomp._arg_lo(0)),
        (seccomp._JEQ, 0, 1, 22),
        (seccomp._RET, 0, 0, seccomp._errno(1)),
        (seccomp._RET, 0, 0, seccomp._ALLOW),
    ])
    seccomp.install(seccomp._program(rules))
    os.execv(sys.executable, [sys.executable, "-m", "services.reward_sandbox.server",
                              *sys.argv[1:]])
""")
"""Starts the server under a filter that refuses seccomp filters and new namespaces, as
a host whose runtime blocks them: only the rlimits tier is left."""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the filter above is x86_64's")
@pytest.mark.parametrize("isolation", ["auto", "rlimits"])
def test_auto_below_seccomp_refuses_to_start(tmp_path: Path, isolation: str) -> None:
    config = tmp_path / "sandbox.json"
    config.write_text(json.dumps({"isolation": isolation, "scratch_root": str(tmp_path / "s"),
                                  "warm_jails": 1}))
    proc = subprocess.Popen(
        [sys.executable, "-c", NO_SECCOMP.format(root=str(ROOT)), "--port", "0",
         "--config", str(config)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        if isolation == "auto":
            output, _ = proc.communicate(timeout=120)
            assert proc.returncode == 2, output
            assert "isolation: auto found no tier stronger than rlimits" in output
            assert "set isolation: rlimits" in output
        else:
            assert proc.stdout is not None
            deadline = time.monotonic() + 120
            line = ""
            while "isolation tier" not in line:
                assert time.monotonic() < deadline and proc.poll() is None, line
                line = proc.stdout.readline()
            assert line.strip() == "isolation tier: rlimits"
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)
