"""The harness: runs a job's tests inside the jail and writes one record per test.

Per test it gets a candidate process, enforces the wall-clock timeout, reads
the candidate's output from memfds it created itself (there is no output path
for a candidate to plant a symlink on), and only once the test has finished
reads that test's nonce and writes the record carrying it to the server.

Who forks the candidates, so that none is a copy of a memory holding a secret:
- A job with assert programs: the template (`TemplateSpawner`), forked once
  the public job is read and before the harness reads the programs. The
  programs run here (see `assert_programs`) and may ask for a new candidate at any
  time, so the harness cannot fork those itself.
- Any other job: the harness itself (`DirectSpawner`), one process fewer per
  job. Such a job has no secret but its nonces, and a candidate is forked
  before its own test's nonce, and every later one, has been read; the server
  counts only the first record per test. So a candidate could at most find the
  nonces of records already written.

Expected outputs of stdio and function-call tests never enter the jail at all.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import time
from typing import Any, Protocol

from . import assert_programs, plain, template, wire
from .assert_programs import CandidateGone

_GRACE = 5.0
_REPLY_CAP = 64 << 20
_ERROR_CHARS = 1000


def _memfd(name: str, data: bytes = b"") -> int:
    fd = os.memfd_create(name, 0)
    if data:
        os.write(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _read_memfd(fd: int, start: int, limit: int) -> tuple[bytes, int]:
    size = os.fstat(fd).st_size
    return os.pread(fd, max(0, min(size - start, limit)), start), size


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


class Spawner(Protocol):
    """Forks candidate processes for the harness and reports how they ended."""

    def spawn(self, mode: str, fds: list[int], limits: dict[str, Any]) -> int:
        """A new candidate running `mode` with `fds` as its 0..3; its pid."""

    def wait_exit(self, pid: int, deadline: float) -> dict[str, Any] | None:
        """{"status": wait status, "cpu": seconds} once `pid` exited; None at `deadline`."""

    def kill(self, pid: int) -> dict[str, Any] | None:
        """SIGKILL `pid` (unless it already exited) and wait for it a grace period."""


class TemplateSpawner:
    """The harness's end of the template socket."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.exits: dict[int, dict[str, Any]] = {}

    @classmethod
    def start(cls, policy: dict[str, Any], code: str, close: list[int]) -> TemplateSpawner:
        """Fork the template now; `close`: descriptors it must not hold."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            mine.close()
            for fd in close:
                os.close(fd)
            template.serve(theirs, policy, code)
        theirs.close()
        return cls(mine)

    def _recv(self, deadline: float | None) -> dict[str, Any] | None:
        wait = None if deadline is None else max(0.001, deadline - time.monotonic())
        self.sock.settimeout(wait)
        try:
            got = wire.recv_msg(self.sock)
        except TimeoutError:
            return None
        if got is None:
            raise RuntimeError("template exited")
        msg = got[0]
        if "exit" in msg:
            self.exits[msg["exit"]] = msg
        return msg

    def spawn(self, mode: str, fds: list[int], limits: dict[str, Any]) -> int:
        wire.send_msg(self.sock, {"op": "spawn", "mode": mode, "limits": limits}, fds)
        while True:
            msg = self._recv(None)
            if msg is not None and "pid" in msg:
                return int(msg["pid"])

    def wait_exit(self, pid: int, deadline: float) -> dict[str, Any] | None:
        while pid not in self.exits:
            if time.monotonic() >= deadline or self._recv(deadline) is None:
                return self.exits.get(pid)
        return self.exits[pid]

    def kill(self, pid: int) -> dict[str, Any] | None:
        if pid not in self.exits:
            wire.send_msg(self.sock, {"op": "kill", "pid": pid})
        return self.wait_exit(pid, time.monotonic() + _GRACE)


class DirectSpawner:
    """Candidates forked by the harness itself, each watched through a pidfd."""

    def __init__(self, policy: dict[str, Any], code: str):
        self.policy = policy
        self.code = code
        self.pidfds: dict[int, int] = {}
        self.exits: dict[int, dict[str, Any]] = {}

    def spawn(self, mode: str, fds: list[int], limits: dict[str, Any]) -> int:
        pid = os.fork()
        if pid == 0:
            template.become_candidate({"mode": mode, "limits": limits}, fds, self.code,
                                      self.policy)
        self.pidfds[pid] = os.pidfd_open(pid)
        return pid

    def wait_exit(self, pid: int, deadline: float) -> dict[str, Any] | None:
        if pid in self.exits:
            return self.exits[pid]
        pidfd = self.pidfds[pid]
        if not select.select([pidfd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            return None
        _, status, usage = os.wait4(pid, 0)
        os.close(self.pidfds.pop(pid))
        self.exits[pid] = {"status": status, "cpu": usage.ru_utime + usage.ru_stime}
        return self.exits[pid]

    def kill(self, pid: int) -> dict[str, Any] | None:
        if pid not in self.exits:
            os.kill(pid, signal.SIGKILL)
        return self.wait_exit(pid, time.monotonic() + _GRACE)


def pidfds_work() -> bool:
    """Whether this kernel (and any seccomp profile around the server) has pidfd_open."""
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (OSError, AttributeError):
        return False
    return True


class Candidate:
    """A serve-mode candidate process with its channel and output memfds."""

    def __init__(self, harness: Harness, deadline: float):
        self.h = harness
        self.out = _memfd("stdout")
        self.err = _memfd("stderr")
        self.out_pos = 0
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        stdin = _memfd("stdin")
        self.pid = harness.spawner.spawn("serve", [stdin, self.out, self.err, theirs.fileno()],
                                          harness.limits(harness.serve_tests_left))
        os.close(stdin)
        theirs.close()
        self.chan = mine
        self.reader = wire.FrameReader(mine.fileno(), _REPLY_CAP)
        self.alive = True
        hello = self._receive(deadline)
        if "compile_error" in hello:
            raise self._gone("compile_error")
        if "load_error" in hello:
            raise self._gone("memory" if hello.get("memory") else "runtime_error")

    def _gone(self, outcome: str, kill: bool = True) -> CandidateGone:
        info = self.h.spawner.kill(self.pid) if kill else self.h.spawner.wait_exit(
            self.pid, time.monotonic() + _GRACE)
        if outcome == "runtime_error":
            # A candidate that vanished mid-conversation failed, whatever its exit
            # status: exiting with 0 must not read as success.
            found = self.h.exit_outcome(info, None, self.out, self.err)
            outcome = "runtime_error" if found == "ok" else found
        out, err = self.take_output()
        self.close()
        return CandidateGone(outcome, out, err)

    def close(self) -> None:
        if self.alive:
            self.alive = False
            self.chan.close()
            os.close(self.out)
            os.close(self.err)

    def _receive(self, deadline: float) -> dict[str, Any]:
        try:
            reply = self.reader.read(deadline)
        except TimeoutError:
            raise self._gone("timeout") from None
        except (EOFError, OSError, wire.FrameError):
            raise self._gone("runtime_error") from None
        if not isinstance(reply, dict):
            raise self._gone("runtime_error")
        if reply.get("output_limit") or self.h.over_output(self.out, self.err):
            raise self._gone("output_limit")
        return reply

    def request(self, req: dict[str, Any], deadline: float) -> dict[str, Any]:
        try:
            wire.write_frame(self.chan.fileno(), req)
        except OSError:
            raise self._gone("runtime_error") from None
        return self._receive(deadline)

    def take_output(self) -> tuple[str, str]:
        cap = int(self.h.job["response_output_bytes"])
        out, size = _read_memfd(self.out, self.out_pos, cap)
        self.out_pos = size
        err, _ = _read_memfd(self.err, 0, cap)
        return _decode(out), _decode(err)


class Harness:
    spawner: Spawner

    def __init__(self, policy: dict[str, Any], direct_spawn: bool):
        """`direct_spawn`: this kernel has pidfds (`pidfds_work`, asked once by the zygote),
        so jobs without assert programs can do without a template."""
        self.policy = policy
        self.direct_spawn = direct_spawn
        self.cand: Candidate | None = None
        self.load_failure: str | None = None
        self.deadline = 0.0

    def limits(self, tests: int) -> dict[str, Any]:
        return {**self.job["limits"], "cpu_seconds": self.timeout * max(1, tests)}

    def run(self, job_fd: int, sec_fd: int, nonce_fd: int, rec_fd: int) -> None:
        """Run every test of the job; one record per test, then the done record."""
        self.job = job = wire.read_json_fd(job_fd)
        self.timeout = float(job["limits"]["timeout_seconds"])
        self.output_bytes = int(job["limits"]["output_bytes"])
        self.serve_tests_left = sum(1 for t in job["tests"] if t["kind"] != "stdio")
        programs: dict[str, str] = {}
        if any(t["kind"] == "assert" for t in job["tests"]) or not self.direct_spawn:
            self.spawner = TemplateSpawner.start(self.policy, job["code"],
                                                 close=[sec_fd, nonce_fd, rec_fd])
            programs = wire.read_json_fd(sec_fd)["programs"]
        else:
            self.spawner = DirectSpawner(self.policy, job["code"])
            os.close(sec_fd)
        nonces = wire.Nonces(nonce_fd)
        for i, test in enumerate(job["tests"]):
            started = time.monotonic()
            self.deadline = started + self.timeout
            record = self.run_test(i, test, programs)
            record.update(nonce=nonces.read(i), test=i,
                          seconds=round(time.monotonic() - started, 4))
            wire.write_frame(rec_fd, record)
        wire.write_frame(rec_fd, {"nonce": nonces.read(len(job["tests"])), "done": True})

    def run_test(self, i: int, test: dict[str, Any], programs: dict[str, str]) -> dict[str, Any]:
        if test["kind"] == "stdio":
            return self.run_stdio(test)
        self.serve_tests_left -= 1
        if test["kind"] == "call":
            return self.run_call(test)
        return self.run_assert(test, programs[str(i)])

    # -- stdio --------------------------------------------------------------

    def over_output(self, out: int, err: int) -> bool:
        return max(os.fstat(out).st_size, os.fstat(err).st_size) > self.output_bytes

    def exit_outcome(self, info: dict[str, Any] | None, status: str | None, out: int,
                     err: int) -> str:
        if info is None:
            return "timeout"
        st = info["status"]
        if os.WIFSIGNALED(st) and (os.WTERMSIG(st) == signal.SIGXCPU or (
                os.WTERMSIG(st) == signal.SIGKILL and info["cpu"] >= self.timeout)):
            return "timeout"
        if self.over_output(out, err) or status == "output_limit":
            return "output_limit"
        if status == "compile_error":
            return "compile_error"
        if status == "memory":
            return "memory"
        if os.WIFEXITED(st) and os.WEXITSTATUS(st) == 0:
            return "ok"
        return "runtime_error"

    def run_stdio(self, test: dict[str, Any]) -> dict[str, Any]:
        stdin = _memfd("stdin", test["stdin"].encode())
        out, err = _memfd("stdout"), _memfd("stderr")
        status_r, status_w = os.pipe()
        pid = self.spawner.spawn("main", [stdin, out, err, status_w], self.limits(1))
        os.close(stdin)
        os.close(status_w)
        info = self.spawner.wait_exit(pid, self.deadline)
        timed_out = info is None
        if timed_out:
            self.spawner.kill(pid)
        status = None
        if not timed_out:
            try:
                msg = wire.FrameReader(status_r, 4096).read(time.monotonic())
                status = str(msg.get("status")) if isinstance(msg, dict) else None
            except (EOFError, TimeoutError, OSError, wire.FrameError):
                pass
        os.close(status_r)
        outcome = self.exit_outcome(None if timed_out else info, status, out, err)
        stdout, _ = _read_memfd(out, 0, self.output_bytes)
        stderr, _ = _read_memfd(err, 0, self.job["response_output_bytes"])
        os.close(out)
        os.close(err)
        return {"outcome": outcome, "stdout": _decode(stdout), "stderr": _decode(stderr)}

    # -- function calls and assert programs -----------------------------------

    def candidate_request(self, req: dict[str, Any]) -> dict[str, Any]:
        if self.load_failure:
            raise CandidateGone(self.load_failure)
        if self.cand is None or not self.cand.alive:
            try:
                self.cand = Candidate(self, self.deadline)
            except CandidateGone as e:
                if e.outcome != "output_limit":
                    self.load_failure = e.outcome
                raise
        return self.cand.request(req, self.deadline)

    def _output(self, gone: CandidateGone | None = None) -> dict[str, str]:
        if gone is not None:
            return {"stdout": gone.stdout, "stderr": gone.stderr}
        if self.cand is None or not self.cand.alive:
            return {"stdout": "", "stderr": ""}
        out, err = self.cand.take_output()
        return {"stdout": out, "stderr": err}

    def run_call(self, test: dict[str, Any]) -> dict[str, Any]:
        try:
            reply = self.candidate_request(
                {"op": "call", "name": test["fn_name"],
                 "args": plain.encode([test["args"], {}])})
        except CandidateGone as e:
            return {"outcome": e.outcome, **self._output(e)}
        if "ok" in reply:
            value = reply["ok"]
            try:
                plain.decode(value)
                size = len(json.dumps(value))
            except (ValueError, TypeError, RecursionError):
                return {"outcome": "not_plain", **self._output()}
            if size > self.output_bytes:
                # The record must stay under the server's cap; a return value is output.
                return {"outcome": "output_limit", **self._output()}
            return {"outcome": "ok", "value": value, **self._output()}
        if "not_plain" in reply:
            return {"outcome": "not_plain", **self._output()}
        outcome = "memory" if reply.get("memory") else "runtime_error"
        return {"outcome": outcome, "error": str(reply.get("raise"))[:_ERROR_CHARS],
                **self._output()}

    def run_assert(self, test: dict[str, Any], program: str) -> dict[str, Any]:
        gone: CandidateGone | None = None
        try:
            outcome, error = assert_programs.run_check(program, test["entry_point"],
                                              self.candidate_request, self.deadline)
        except CandidateGone as e:
            outcome, error, gone = e.outcome, "", e
        except assert_programs.CheckTimeout:
            outcome, error = "timeout", ""
            if self.cand is not None and self.cand.alive:
                self.cand._gone("timeout")
        return {"outcome": outcome, "error": error[:_ERROR_CHARS], **self._output(gone)}
