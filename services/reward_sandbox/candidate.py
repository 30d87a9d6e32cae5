"""The candidate process: the only place where the submitted code runs.

It is forked from the template, or, for a job without assert programs, from
the harness before any nonce it could use was read (see `harness`). It
confines itself (rlimits, no capabilities, the strict seccomp filter) and then
either runs the code as `__main__` once with a test's stdin ("main" mode), or
imports it as module `solution` and answers call requests from the harness
("serve" mode).

Arguments and results cross as plain values (see `plain`); the candidate never
sees an expected output, an assert program or a nonce still to be used, and it
has no descriptor through which it could write a test record. Whatever it
sends back is data the harness checks: lying can only fail a test.
"""

from __future__ import annotations

import builtins
import io
import os
import resource
import sys
import traceback
import types
from typing import Any, NoReturn

from . import plain, seccomp, syscalls, wire

STDIN, STDOUT, STDERR, CHANNEL = 0, 1, 2, 3
_REQUEST_CAP = 1 << 30


def confine(policy: dict[str, Any], limits: dict[str, Any]) -> None:
    """Apply this process's resource limits and filters; irreversible."""
    if policy["rlimits"]:
        address_space = policy["baseline_vsz"] + limits["memory_bytes"]
        cpu = int(limits["cpu_seconds"]) + 1
        for which, value in (
            (resource.RLIMIT_AS, address_space),
            (resource.RLIMIT_CPU, cpu),
            (resource.RLIMIT_FSIZE, limits["file_bytes"]),
            (resource.RLIMIT_NOFILE, 64),
            (resource.RLIMIT_CORE, 0),
            (resource.RLIMIT_MEMLOCK, 0),
            (resource.RLIMIT_MSGQUEUE, 0),
        ):
            hard = value + 1 if which == resource.RLIMIT_CPU else value
            resource.setrlimit(which, (value, hard))
        nproc = policy["nproc"]
        if policy.get("nproc_above_uid"):
            nproc = uid_tasks(os.getuid()) + policy["nproc_above_uid"]
        if nproc:
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    if policy["namespaces"]:
        syscalls.drop_capabilities()
    if policy["seccomp"]:
        seccomp.install_strict(os.getpid())


def uid_tasks(uid: int) -> int:
    """Tasks (processes and threads) of `uid` now, as RLIMIT_NPROC counts them."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status", "rb") as f:
                status = f.read()
        except OSError:  # gone, or not ours to read
            continue
        fields = dict(line.split(b":", 1) for line in status.splitlines() if b":" in line)
        if int(fields.get(b"Uid", b"-1 ").split()[0]) == uid:
            total += int(fields.get(b"Threads", b"1").strip())
    return total


_HOST_PATHS = sorted({p for q in (sys.base_prefix, sys.prefix, sys.base_exec_prefix)
                      for p in (q, os.path.realpath(q))}, key=len, reverse=True)
_MARL_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _print_traceback(exc: BaseException) -> None:
    """The program's traceback as a caller may see it: from its own first frame on
    (not this runner's), with the host's install paths replaced by `<python>`."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != "solution.py":
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__))
    text = text.replace(_MARL_ROOT, "<sandbox>")
    for path in _HOST_PATHS:
        text = text.replace(path, "<python>")
    sys.stderr.write(text)


def _std_streams() -> None:
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(STDIN, "rb", closefd=False)),
                                 encoding="utf-8", errors="replace")
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(STDOUT, "wb", closefd=False)),
                                  encoding="utf-8", errors="backslashreplace")
    sys.stderr = io.TextIOWrapper(io.BufferedWriter(io.FileIO(STDERR, "wb", closefd=False)),
                                  encoding="utf-8", errors="backslashreplace",
                                  line_buffering=True)
    for name in ("stdin", "stdout", "stderr"):
        setattr(sys, f"__{name}__", getattr(sys, name))
    sys.argv = ["solution.py"]


_prepared_builtins: types.ModuleType | None = None


def prepare() -> None:
    """Copy the builtins now, in the zygote: every candidate is a fresh fork, so each
    gets a pristine copy of its own without paying for the ~160 reference updates
    (and the memory pages they copy) itself."""
    global _prepared_builtins
    _prepared_builtins = _copy_builtins()


def _copy_builtins() -> types.ModuleType:
    own = types.ModuleType("builtins")
    own.__dict__.update(builtins.__dict__)
    return own


def _private_builtins() -> dict[str, Any]:
    """A builtins module of the code's own, so patching it cannot reach this runner."""
    own = _prepared_builtins or _copy_builtins()
    sys.modules["builtins"] = own
    return own.__dict__


def _compile(code: str) -> types.CodeType | str:
    try:
        return compile(code, "solution.py", "exec", dont_inherit=True)
    except (SyntaxError, ValueError, OverflowError, RecursionError, MemoryError) as e:
        return "".join(traceback.format_exception_only(type(e), e))


def _flush() -> str | None:
    """Flush stdio; 'output_limit' when the file-size limit cut the output."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError as e:
            if e.errno == 27:  # EFBIG
                return "output_limit"
        except (ValueError, AttributeError):
            pass
    return None


def _report(obj: dict[str, Any]) -> None:
    try:
        wire.write_frame(CHANNEL, obj)
    except OSError:
        pass


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    print(e.code, file=sys.stderr)
    return 1


def run_main(code: str) -> NoReturn:
    """Run the code as a script: stdin from the test, exit status and output judged later."""
    _std_streams()
    compiled = _compile(code)
    if isinstance(compiled, str):
        sys.stderr.write(compiled)
        _flush()
        _report({"status": "compile_error"})
        os._exit(1)
    main = types.ModuleType("__main__")
    main.__file__ = "solution.py"
    main.__builtins__ = _private_builtins()  # type: ignore[attr-defined]
    sys.modules["__main__"] = main
    status, exit_code = "ok", 0
    try:
        exec(compiled, main.__dict__)
    except SystemExit as e:
        exit_code = _exit_code(e)
    except MemoryError:
        status, exit_code = "memory", 1
    except BaseException as e:  # the program's own crash, reported like the interpreter would
        status, exit_code = "exception", 1
        try:
            _print_traceback(e)
        except BaseException:
            pass
    status = _flush() or status
    _report({"status": status})
    os._exit(exit_code)


def _resolve(ns: dict[str, Any], name: str) -> Any:
    if name in ns:
        return ns[name]
    solution = ns.get("Solution")
    if isinstance(solution, type) and hasattr(solution, name):
        return getattr(solution(), name)
    raise NameError(f"name {name!r} is not defined")


def _call(ns: dict[str, Any], req: dict[str, Any]) -> dict[str, Any]:
    args, kwargs = plain.decode(req["args"])
    try:
        result = _resolve(ns, req["name"])(*args, **kwargs)
    except MemoryError:
        return {"raise": "MemoryError", "msg": "", "memory": True}
    except BaseException as e:  # the candidate's exception is the test's outcome
        try:
            return {"raise": type(e).__name__[:200], "msg": str(e)[:1000]}
        except BaseException:  # a str() or a name that itself raises
            return {"raise": "Exception", "msg": ""}
    try:
        reply: dict[str, Any] = {"ok": plain.encode(result)}
        if req.get("writeback"):
            reply["args"] = plain.encode(args)
    except plain.NotPlain as e:
        return {"not_plain": str(e)}
    return reply


def _lookup(ns: dict[str, Any], name: str) -> dict[str, Any]:
    try:
        value = _resolve(ns, name)
    except NameError:
        return {"missing": True}
    if callable(value):
        return {"callable": True}
    try:
        return {"value": plain.encode(value)}
    except plain.NotPlain as e:
        return {"not_plain": str(e)}


def run_serve(code: str) -> NoReturn:
    """Import the code as module `solution`, then answer call requests until EOF."""
    _std_streams()
    compiled = _compile(code)
    if isinstance(compiled, str):
        sys.stderr.write(compiled)
        _flush()
        _report({"compile_error": compiled[-2000:]})
        os._exit(1)
    module = types.ModuleType("solution")
    module.__file__ = "solution.py"
    module.__builtins__ = _private_builtins()  # type: ignore[attr-defined]
    sys.modules["solution"] = module
    ns = module.__dict__
    try:
        exec(compiled, ns)
    except MemoryError:
        _flush()
        _report({"load_error": "MemoryError", "memory": True})
        os._exit(1)
    except BaseException as e:  # includes SystemExit: exiting while loading is a failure
        try:
            _print_traceback(e)
        except BaseException:
            pass
        _flush()
        _report({"load_error": type(e).__name__[:200]})
        os._exit(1)
    _flush()
    _report({"loaded": True})
    reader = wire.FrameReader(CHANNEL, _REQUEST_CAP)
    while True:
        try:
            req = reader.read(None)
        except (EOFError, OSError, wire.FrameError):
            os._exit(0)
        reply = _call(ns, req) if req["op"] == "call" else _lookup(ns, req["name"])
        cut = _flush()
        if cut:
            reply = {"output_limit": True}
        try:
            wire.write_frame(CHANNEL, reply)
        except (OSError, TypeError, ValueError):
            os._exit(1)
