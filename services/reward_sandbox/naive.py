"""Sabotage mode: a deliberately naive grader, for proving the deny tests work.

Used only when the server runs with MARL_SANDBOX_SABOTAGE=1 (tests and CI).
It does what unsafe graders do: the code runs with the server's environment,
no limits, no seccomp, no namespaces; the test's expected values are written
to disk and held in the same process as the code; the verdict is decided
inside that process (`==`, exit status 0, a "PASSED" line on stdout); the
timeout is an in-process alarm; nothing is cleaned up. Every `test_deny_*`
must fail against it. Never enable it anywhere else.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any, NoReturn

from . import verdicts, wire

MARKER = "__MARL_RESULT__ "


def run(job: dict[str, Any], rec_fd: int, sec_fd: int, nonce_fd: int) -> None:
    secrets = wire.read_json_fd(sec_fd)
    nonces = wire.Nonces(nonce_fd)
    for i, test in enumerate(job["tests"]):
        record = _run_test(job, test, secrets, i)
        wire.write_frame(rec_fd, {"nonce": nonces.read(i), "test": i, **record})
    wire.write_frame(rec_fd, {"nonce": nonces.read(len(job["tests"])), "done": True})


def _run_test(job: dict[str, Any], test: dict[str, Any], secrets: dict[str, Any],
              i: int) -> dict[str, Any]:
    out = os.memfd_create("stdout", 0)
    err = os.memfd_create("stderr", 0)
    pid = os.fork()
    if pid == 0:
        _child(job, test, secrets, i, out, err)
    _, status = os.waitpid(pid, 0)
    stdout = os.pread(out, os.fstat(out).st_size, 0).decode(errors="replace")
    stderr = os.pread(err, 4096, 0).decode(errors="replace")
    code = os.waitstatus_to_exitcode(status)
    marks = [line for line in stdout.splitlines() if line.startswith(MARKER)]
    if code == 124:
        verdict = "TIMEOUT"
    elif marks:
        verdict = marks[-1][len(MARKER):].strip()
    elif code != 0:
        verdict = "RUNTIME_ERROR"
    elif test["kind"] == "stdio":
        verdict = "PASSED" if verdicts.stdout_matches(stdout, secrets["expected"][str(i)]) \
            else "FAILED"
    else:
        verdict = "PASSED"
    return {"outcome": "ok", "verdict": verdict, "stdout": stdout, "stderr": stderr}


def _child(job: dict[str, Any], test: dict[str, Any], secrets: dict[str, Any], i: int,
           out: int, err: int) -> NoReturn:
    expected = secrets["expected"].get(str(i))
    program = secrets["programs"].get(str(i), "")
    stdin = os.memfd_create("stdin", 0)
    os.write(stdin, test.get("stdin", "").encode())
    os.lseek(stdin, 0, 0)
    for fd, target in ((stdin, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    source = job["code"]
    if test["kind"] == "call":
        source += (f"\n_expected = {expected!r}\n_result = {test['fn_name']}(*{test['args']!r})\n"
                   f"print({MARKER!r} + ('PASSED' if _result == _expected else 'FAILED'))\n")
    elif test["kind"] == "assert":
        source += f"\n{program}\ncheck({test['entry_point']})\n"
    with open("main.py", "w") as f:
        f.write(source)

    def alarm(*_: Any) -> None:
        raise TimeoutError

    signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, float(job["limits"]["timeout_seconds"]))
    code = 0
    try:
        exec(compile(source, "main.py", "exec"), {"__name__": "__main__"})
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0
    except TimeoutError:
        code = 124
    except BaseException:
        code = 1
    sys.stdout.flush()
    os._exit(code)
