"""A service process exits within its drain time plus 10 s of a stop (marl.runtime.serving's
StopWatchdog), even when its cleanup hangs (as on a Redis that is gone), and stops by
itself once the launcher that started it is gone. Each case is a real process running
`serve_until_stopped`, as a service does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from marl.runtime.serving import STOP_MARGIN_S

SERVICE = textwrap.dedent(
    """
    import asyncio, sys
    from marl.runtime.serving import ServiceHost, serve_until_stopped

    async def stubborn():
        # cleanup stuck forever: every cancel is swallowed, as a Redis client retrying
        # a command against a Redis that is gone can
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass

    async def idle():
        await asyncio.sleep(3600)

    async def main():
        host = ServiceHost([], "127.0.0.1", 0)
        loop = stubborn if sys.argv[1] == "stubborn" else idle
        await serve_until_stopped(host, background=[loop], drain_s=float(sys.argv[2]))

    asyncio.run(main())
    """
)


def start(kind: str, drain_s: float, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVICE, kind, str(drain_s)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "listening on ...": its signal handlers are in place
    assert "listening on" in line, line
    time.sleep(0.5)  # serve_until_stopped installs the watchdog right after
    return proc


def test_a_stop_whose_cleanup_hangs_ends_within_drain_plus_the_margin() -> None:
    drain_s = 1.0
    proc = start("stubborn", drain_s)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=drain_s + 10)
    took = time.monotonic() - t0
    out = proc.stdout.read() if proc.stdout else ""
    assert code == 1, out
    assert "stop-watchdog" in out and "SIGTERM" in out
    assert drain_s + STOP_MARGIN_S - 0.5 <= took <= drain_s + 10, took


def test_a_clean_stop_exits_at_once_with_0() -> None:
    proc = start("idle", 0.0)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0
    assert time.monotonic() - t0 < STOP_MARGIN_S


LAUNCHER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from marl.runtime.serving import PARENT_PID_ENV
    log = open(sys.argv[2], "w")
    child = subprocess.Popen(
        [sys.executable, "-c", sys.argv[1], "idle", "0"],
        env={**os.environ, PARENT_PID_ENV: str(os.getpid())}, stdout=log, stderr=log,
    )
    print(child.pid, flush=True)
    time.sleep(3600)
    """
)


def gone(pid: int) -> bool:
    """Exited (a zombie waiting for init counts: it runs no more)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def test_a_service_whose_launcher_is_sigkilled_stops(tmp_path: Path) -> None:
    """No PR_SET_PDEATHSIG here (a plain Popen): the watchdog sees its parent's pid change."""
    log = tmp_path / "service.log"
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, SERVICE, str(log)], stdout=subprocess.PIPE, text=True
    )
    assert launcher.stdout is not None
    pid = int(launcher.stdout.readline())
    deadline = time.monotonic() + 60
    while not log.exists() or "listening on" not in log.read_text():
        assert time.monotonic() < deadline, "the service did not start"
        time.sleep(0.1)
    time.sleep(0.5)
    launcher.kill()
    launcher.wait()
    t0 = time.monotonic()
    while not gone(pid):
        if time.monotonic() - t0 > 10:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"orphaned service still running after 10 s: {log.read_text()}")
        time.sleep(0.1)
    assert time.monotonic() - t0 < STOP_MARGIN_S
