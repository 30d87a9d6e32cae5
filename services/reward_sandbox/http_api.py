"""SandboxFusion's `POST /run_code` on the sandbox's HTTP port, for verl, ROLL and its client.

The request and response follow SandboxFusion's `RunCodeRequest` /
`RunCodeResponse`. A call becomes one stdio job of the gRPC path (same
`jobspec` validation, same admission in `SandboxService.run_job`, same warm
jails and limits), so an HTTP job is refused with 429 exactly when `Execute`
would be refused with RESOURCE_EXHAUSTED.

SandboxFusion has two things marl's jobs do not: request files and the exit
status. Both are carried by a small runner that wraps the submitted code: it
writes the request's files into the job's private working directory, runs the
code as `__main__` (stdin is the test's stdin), and after it ends appends one
trailer line to stderr, after a per-request random marker, with the return
code and the fetched files. The trailer is written by code running in the
same jail as the submitted program, so a program can forge it; it can then
only misreport its own exit status and files, which it controls anyway.
Nothing the server decides depends on it. What it does mean: fetched files
travel through stderr and count toward the output limit, and a program that
ends itself with `os._exit` or a signal reports return code 1 (the trailer
is never written).

Supported: `language` "python"; `code`, `stdin`, `run_timeout` (seconds,
up to the server's `max_timeout_seconds`), `memory_limit_MB` (-1: default),
`files` (relative paths, base64; together with the code at most
`max_code_bytes`), `fetch_files` (relative paths; missing ones are left out,
as SandboxFusion does). `compile_timeout` is accepted and unused (Python is
not compiled ahead). Other languages are refused with 400 naming them.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import math
import posixpath
import secrets
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from marl.protocol.v1 import sandbox_pb2
from marl.runtime.http_server import HttpServer, json_response, read_json_object

from . import jobspec
from .executor import TestOutcome
from .forkserver_client import ZygoteError
from .service import SandboxBusy, SandboxService, SandboxStarting

log = logging.getLogger(__name__)

LANGUAGES = ("python",)
_FIELDS = {"code", "language", "stdin", "run_timeout", "compile_timeout", "memory_limit_MB",
           "files", "fetch_files"}

# Runs as the job's `__main__` in the jail; `_MARL` is replaced by the request.
_RUNNER = r'''
import base64, json, linecache, os, sys, traceback, types
def _marl_run(req):
    root = os.getcwd()
    # tracebacks show source lines, as when python runs main.py from disk
    linecache.cache["main.py"] = (len(req["code"]), None, req["code"].splitlines(True), "main.py")
    for path, data in req["files"].items():
        full = os.path.join(root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb") as f:
            f.write(base64.b64decode(data))
    main = types.ModuleType("__main__")
    main.__file__ = "main.py"
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    code = 0
    try:
        exec(compile(req["code"], "main.py", "exec", dont_inherit=True), main.__dict__)
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code & 0xFF
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException as e:
        code = 1
        try:
            traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        except BaseException:
            pass
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except BaseException:
            pass
    files = {}
    for path in req["fetch"]:
        try:
            with open(os.path.join(root, path), "rb") as f:
                files[path] = base64.b64encode(f.read()).decode()
        except OSError:
            pass
    trailer = "\n" + req["marker"] + json.dumps({"return_code": code, "files": files}) + "\n"
    try:
        os.write(2, trailer.encode())
    except OSError:
        pass
    raise SystemExit(code)
_marl_run(json.loads(_MARL))
'''


@dataclass
class RunCodeRequest:
    code: str
    stdin: str
    run_timeout: float
    memory_bytes: int
    files: dict[str, str]
    fetch_files: list[str]


def _relative_path(path: Any, where: str) -> str:
    if not isinstance(path, str) or not path:
        raise ValueError(f"{where}: a file path must be a non-empty string")
    norm = posixpath.normpath(path)
    if path.startswith("/") or norm == ".." or norm.startswith("../") or "\0" in path:
        raise ValueError(f"{where}: {path!r} must be a relative path inside the working "
                         "directory (no leading '/', no '..')")
    return norm


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name}: must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name}: must be a finite number, got {value!r}")
    return float(value)


def parse_request(body: dict[str, Any], max_code_bytes: int) -> RunCodeRequest:
    """Validate a RunCodeRequest body; every problem is a ValueError naming the field."""
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise ValueError(f"{unknown[0]}: not a field of RunCodeRequest (fields: "
                         f"{', '.join(sorted(_FIELDS))})")
    language = body.get("language")
    if language is None:
        raise ValueError("language: required (marl runs 'python')")
    if language not in LANGUAGES:
        raise ValueError(f"language: {language!r} is not supported by marl's sandbox; "
                         f"it runs {', '.join(LANGUAGES)} only")
    code = body.get("code")
    if not isinstance(code, str):
        raise ValueError("code: required, a string")
    stdin = body.get("stdin")
    if stdin is not None and not isinstance(stdin, str):
        raise ValueError("stdin: must be a string or null")
    run_timeout = _number(body, "run_timeout", 10.0)
    if run_timeout <= 0:
        raise ValueError(f"run_timeout: must be positive, got {run_timeout:g}")
    _number(body, "compile_timeout", 10.0)
    memory_mb = _number(body, "memory_limit_MB", -1)
    files_in = body.get("files") or {}
    if not isinstance(files_in, dict):
        raise ValueError("files: must be an object from path to base64 content")
    files: dict[str, str] = {}
    size = len(code.encode())
    for path, content in files_in.items():
        where = f"files[{path!r}]"
        norm = _relative_path(path, where)
        if content is None:
            continue
        if not isinstance(content, str):
            raise ValueError(f"{where}: must be base64 text")
        try:
            base64.b64decode(content, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"{where}: not valid base64") from None
        files[norm] = content
        size += len(content)
    if size > max_code_bytes:
        raise ValueError(f"code: code and files (base64) come to {size} bytes, over this "
                         f"server's {max_code_bytes} byte limit (max_code_bytes)")
    fetch_in = body.get("fetch_files") or []
    if not isinstance(fetch_in, list):
        raise ValueError("fetch_files: must be a list of paths")
    fetch = [_relative_path(p, f"fetch_files[{i}]") for i, p in enumerate(fetch_in)]
    return RunCodeRequest(code, stdin or "", run_timeout,
                          0 if memory_mb <= 0 else int(memory_mb * (1 << 20)), files, fetch)


def build_job(req: RunCodeRequest, service: SandboxService, marker: str) -> jobspec.Job:
    """The runner-wrapped code as one stdio job, through the same validation as `Execute`."""
    payload = json.dumps({"code": req.code, "files": req.files, "fetch": req.fetch_files,
                          "marker": marker})
    program = f"_MARL = {payload!r}\n{_RUNNER}"
    cfg = service.cfg
    limits = sandbox_pb2.Limits(timeout_seconds=req.run_timeout, memory_bytes=req.memory_bytes)
    request = sandbox_pb2.ExecuteRequest(
        code=program, tests=[sandbox_pb2.Test(stdio=sandbox_pb2.StdioTest(stdin=req.stdin))],
        limits=limits)
    try:
        # `parse_request` held the code and files to max_code_bytes; the runner is ours
        job = jobspec.parse(request, cfg.model_copy(update={
            "max_code_bytes": max(cfg.max_code_bytes, len(program.encode()))}))
    except ValueError as err:
        raise ValueError(str(err).replace("limits.timeout_seconds", "run_timeout")
                         .replace("limits.memory_bytes", "memory_limit_MB")) from None
    # The whole output is the answer here (no expected stdout to compare with).
    job.response_output_bytes = job.limits.output_bytes
    return job


def _split_trailer(stderr: str, marker: str) -> tuple[str, dict[str, Any] | None]:
    at = stderr.rfind(marker)
    if at < 0:
        return stderr, None
    try:
        trailer = json.loads(stderr[at + len(marker):])
    except ValueError:
        return stderr, None
    head = stderr[:at]
    return (head[:-1] if head.endswith("\n") else head), trailer


def run_code_response(outcome: TestOutcome, marker: str, fetch: list[str],
                      tier: str) -> dict[str, Any]:
    """SandboxFusion's RunCodeResponse for one finished job."""
    if outcome.verdict == "SANDBOX_ERROR":
        return {"status": "SandboxError", "message": outcome.error or "the sandbox failed",
                "compile_result": None, "run_result": None, "executor_pod_name": None,
                "files": {}, "isolation_tier": tier}
    stderr, trailer = _split_trailer(outcome.stderr, marker)
    files: dict[str, str] = {}
    message = ""
    if outcome.verdict == "TIMEOUT":
        status, return_code = "TimeLimitExceeded", None
    else:
        status = "Finished"
        return_code = 0 if outcome.verdict in ("PASSED", "FAILED") else 1
        if trailer is not None and isinstance(trailer.get("return_code"), int):
            return_code = int(trailer["return_code"])
            got = trailer.get("files")
            if isinstance(got, dict):
                files = {p: str(got[p]) for p in fetch if p in got}
        if outcome.verdict == "OUTPUT_LIMIT":
            message = "output over the job's output limit; stdout/stderr were cut"
            return_code = return_code or 1
        elif outcome.verdict == "MEMORY_LIMIT":
            message = "memory limit exceeded"
            return_code = return_code or 1
    ok = status == "Finished" and return_code == 0
    return {
        "status": "Success" if ok else "Failed",
        "message": message,
        "compile_result": None,
        "run_result": {"status": status, "execution_time": outcome.seconds, "cpu_time": None,
                       "return_code": return_code, "stdout": outcome.stdout, "stderr": stderr},
        "executor_pod_name": None,
        "files": files,
        "isolation_tier": tier,
    }


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return json_response({"status": "SandboxError", "message": message}, status, headers)


def add_routes(http: HttpServer, service: SandboxService) -> None:
    """Mount `POST /run_code` on the service's HTTP server."""

    async def run_code(request: web.Request) -> web.Response:
        try:
            req = parse_request(await read_json_object(request), service.cfg.max_code_bytes)
            marker = f"\x1e\x1emarl-run-code-{secrets.token_hex(16)}:"
            job = build_job(req, service, marker)
        except ValueError as err:
            return _error(400, str(err))
        try:
            result = await service.run_job(job)
        except SandboxStarting as err:
            return _error(503, str(err), {"Retry-After": "1"})
        except SandboxBusy as err:
            return _error(429, str(err), {"Retry-After": "1"})
        except ZygoteError as err:
            log.error("job lost: %s", err)
            return _error(503, f"{err}; it is being restarted, retry the call",
                          {"Retry-After": "1"})
        return json_response(run_code_response(result.results[0], marker, req.fetch_files,
                                               result.tier))

    http.app.router.add_post("/run_code", run_code)
