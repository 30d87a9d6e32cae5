"""Run one job: hand its descriptors to a jail, collect records, always clean up.

The public job, the secrets (assert programs) and the nonces go into three
memfds, records come back on a pipe. Every test has a nonce of its own, and
so has the done record: the harness reads a test's nonce only once that test
has run, so no candidate process is ever forked from a memory that holds the
nonce of a record still to be written. Only the first record carrying its
test's nonce counts; a test without one is TIMEOUT if the job ran out of time
and SANDBOX_ERROR otherwise. Whatever happens (done, deadline, client
cancellation, error) the job's process group is SIGKILLed in `finally` and its
scratch directory removed, so a cancelled call frees its slot within a second
and nothing is left behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import select
import shutil
import signal
import struct
import tempfile
from dataclasses import dataclass
from typing import Any

from . import plain, verdicts, wire
from .forkserver_client import ZygoteClient
from .jobspec import Job

NOBODY = 65534
_HEADER = struct.Struct(">I")


@dataclass
class TestOutcome:
    verdict: str
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    error: str = ""


@dataclass
class JobResult:
    results: list[TestOutcome]
    pass_rate: float
    tier: str


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, 0)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


class Executor:
    def __init__(self, zygote: ZygoteClient, tier: str, scratch_root: str,
                 job_overhead: float):
        self.zygote = zygote
        self.tier = tier
        self.sabotage = tier == "none"
        self.scratch_root = scratch_root
        self.job_overhead = job_overhead

    async def run(self, job: Job, time_left: float | None) -> JobResult:
        budget = job.budget(self.job_overhead)
        if time_left is not None:
            budget = min(budget, time_left)
        nonces = [secrets.token_hex(wire.Nonces.WIDTH // 2) for _ in range(len(job.tests) + 1)]
        scratch = None if self.tier == "namespaces" else self._scratch()
        job_fd = _memfd("job", json.dumps(job.public()).encode())
        sec_fd = _memfd("secrets", json.dumps(job.secrets(self.sabotage)).encode())
        nonce_fd = _memfd("nonces", "".join(nonces).encode())
        rec_r, rec_w = os.pipe()
        pid: int | None = None
        pidfd: int | None = None
        records: dict[int, dict[str, Any]] = {}
        fatal = ""
        timed_out = False
        try:
            try:
                pid = await self.zygote.spawn({"scratch": scratch},
                                              [job_fd, sec_fd, nonce_fd, rec_w])
            finally:
                for fd in (job_fd, sec_fd, nonce_fd, rec_w):
                    os.close(fd)
            pidfd = _pidfd(pid)
            cap = 8 * job.limits.output_bytes + (1 << 20)
            if self.sabotage:
                cap = 1 << 31
            try:
                async with asyncio.timeout(max(0.0, budget)):
                    fatal = await self._collect(rec_r, nonces, cap, records)
            except TimeoutError:
                timed_out = True
        finally:
            if pid is not None and not self.sabotage:
                _kill_group(pid, pidfd)
            if pidfd is not None:
                os.close(pidfd)
            os.close(rec_r)
            if scratch is not None and not self.sabotage:
                shutil.rmtree(scratch, ignore_errors=True)
        return self._verdicts(job, records, timed_out, fatal)

    def _scratch(self) -> str:
        path = tempfile.mkdtemp(prefix="job-", dir=self.scratch_root)
        if os.geteuid() == 0 and not self.sabotage:
            os.chown(path, NOBODY, NOBODY)
        return path

    async def _collect(self, fd: int, nonces: list[str], cap: int,
                       records: dict[int, dict[str, Any]]) -> str:
        """Read frames until the done record; returns a jail error message, if any.

        A reader callback on the pipe, not a stream transport: the server pays for
        every job's set-up, and frames are small and few."""
        loop = asyncio.get_running_loop()
        os.set_blocking(fd, False)
        result: asyncio.Future[str] = loop.create_future()
        buf = bytearray()

        def finish(message: str) -> None:
            loop.remove_reader(fd)
            if not result.done():
                result.set_result(message)

        def on_readable() -> None:
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                return
            if not chunk:
                return finish("the jail exited before it finished")
            buf.extend(chunk)
            while len(buf) >= _HEADER.size:
                (size,) = _HEADER.unpack_from(buf)
                if size > cap:
                    return finish(f"record of {size} bytes is over the cap")
                if len(buf) < _HEADER.size + size:
                    return
                data = bytes(buf[_HEADER.size:_HEADER.size + size])
                del buf[:_HEADER.size + size]
                try:
                    frame = json.loads(data)
                except (ValueError, RecursionError):
                    return finish("the jail exited before it finished")
                if not isinstance(frame, dict):
                    continue
                if "fatal" in frame:
                    return finish(str(frame["fatal"]))
                if frame.get("done") is True and frame.get("nonce") == nonces[-1]:
                    return finish("")
                test = frame.get("test")
                if (isinstance(test, int) and 0 <= test < len(nonces) - 1
                        and frame.get("nonce") == nonces[test] and test not in records):
                    records[test] = frame

        loop.add_reader(fd, on_readable)
        try:
            return await result
        finally:
            loop.remove_reader(fd)

    def _verdicts(self, job: Job, records: dict[int, dict[str, Any]], timed_out: bool,
                  fatal: str) -> JobResult:
        results = []
        for i, test in enumerate(job.tests):
            rec = records.get(i)
            if rec is None:
                verdict = "TIMEOUT" if timed_out else "SANDBOX_ERROR"
                results.append(TestOutcome(verdict, error=fatal[:1000]))
                continue
            if self.sabotage:
                verdict = str(rec.get("verdict"))
            else:
                value = None
                if test["kind"] == "call" and rec.get("outcome") == "ok":
                    try:
                        value = plain.decode(rec.get("value"))
                    except ValueError:
                        rec["outcome"] = "failed"
                verdict = verdicts.verdict(test["kind"], str(rec.get("outcome")),
                                        stdout=str(rec.get("stdout", "")),
                                        expected_stdout=job.expected[i] or "",
                                        value=value, expected=job.expected[i])
            trim = job.response_output_bytes
            results.append(TestOutcome(
                verdict, str(rec.get("stdout", ""))[:trim], str(rec.get("stderr", ""))[:trim],
                float(rec.get("seconds", 0.0)),
                "" if verdict == "PASSED" else str(rec.get("error") or rec.get("outcome"))[:1000]))
        passed = sum(r.verdict == "PASSED" for r in results)
        return JobResult(results, passed / len(results), self.tier)


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


def _kill_group(pid: int, pidfd: int | None) -> None:
    """SIGKILL the job's process group while its leader still holds the group id."""
    if pidfd is not None and select.select([pidfd], [], [], 0)[0]:
        return  # the leader is gone; its group id may already belong to someone else
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
