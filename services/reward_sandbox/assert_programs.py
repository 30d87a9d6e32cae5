"""Assert programs (HumanEval's `check(candidate)`), run in the harness, never in the candidate.

The program runs in a fresh namespace with the harness's own, untouched
builtins. `candidate`, and any other name the program takes from the submitted
code (helpers such as `poly`), are `RemoteFunction`s: a call sends its
arguments to the candidate process as plain values and returns a fresh plain
value, so an always-equal object, a patched builtin or a patched `unittest`
in the candidate cannot change how the program's asserts evaluate. In-place
changes the candidate makes to list, dict or set arguments are mirrored back.

Outcomes: ok (check returned), failed (an assertion, or the program's own
error), not_plain (the candidate returned something that is not plain data),
runtime_error (an exception the candidate raised escaped the program), or
what `CandidateGone` carries (timeout, memory, output_limit, ...).
"""

from __future__ import annotations

import builtins
import contextlib
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

from . import plain

Request = Callable[[dict[str, Any]], dict[str, Any]]


class CandidateGone(Exception):
    """The candidate cannot answer; `outcome` says why (timeout, memory, ...)."""

    def __init__(self, outcome: str, stdout: str = "", stderr: str = ""):
        super().__init__(outcome)
        self.outcome = outcome
        self.stdout = stdout
        self.stderr = stderr


class NotPlainResult(Exception):
    """The candidate returned something that is not plain data (e.g. an always-equal object)."""


class CheckTimeout(BaseException):
    """The test's deadline passed; a BaseException so the program cannot catch it as Exception."""


class RemoteFunction:
    """Stands for a function of the submitted code inside an assert program."""

    def __init__(self, request: Request, name: str, raised: set[int]):
        self.request = request
        self.raised = raised
        self.__name__ = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            encoded = plain.encode([list(args), kwargs])
        except plain.NotPlain as e:
            raise TypeError(f"sandbox: arguments of {self.__name__} must be plain data: "
                            f"{e}") from None
        reply = self.request(
            {"op": "call", "name": self.__name__, "args": encoded, "writeback": True})
        if "not_plain" in reply:
            raise NotPlainResult(reply["not_plain"])
        if "raise" in reply:
            if reply.get("memory"):
                raise CandidateGone("memory")
            exc = _rebuild_exception(reply["raise"], reply.get("msg", ""))
            self.raised.add(id(exc))
            raise exc
        try:
            value = plain.decode(reply["ok"])
            _write_back(args, plain.decode(reply.get("args", [])))
        except (KeyError, ValueError, IndexError, TypeError):
            raise CandidateGone("runtime_error") from None
        return value


def _write_back(originals: tuple[Any, ...], updated: list[Any]) -> None:
    """Mirror in-place changes the candidate made to list/dict/set arguments."""
    for old, new in zip(originals, updated, strict=False):
        if type(old) is list and type(new) is list:
            old[:] = new
        elif type(old) is dict and type(new) is dict:
            old.clear()
            old.update(new)
        elif type(old) is set and type(new) is set:
            old.clear()
            old.update(new)


_STEERING = (StopIteration, StopAsyncIteration)
"""Exceptions that end iteration instead of failing: raised from a candidate inside
`map`, `filter`, `zip` or `next(it, default)`, a StopIteration would silently cut
the test's loop short (`all(map(...))` over no items is True)."""


def _rebuild_exception(name: str, msg: str) -> BaseException:
    """The candidate's exception as the assert program sees it: the builtin of that
    name (tests may expect ValueError), except one that steers iteration."""
    cls = getattr(builtins, str(name), None)
    if (isinstance(cls, type) and issubclass(cls, Exception)
            and not issubclass(cls, _STEERING)):
        try:
            return cls(msg)
        except Exception:  # exceptions whose constructor wants more arguments
            pass
    return RuntimeError(f"{name}: {msg}")


class ProxyBuiltins(dict):  # type: ignore[type-arg]
    """Builtins of an assert program; a missing name is looked up in the submitted code."""

    def __init__(self, request: Request, raised: set[int]):
        super().__init__(builtins.__dict__)
        self.request = request
        self.raised = raised

    def __missing__(self, name: str) -> Any:
        if name.startswith("__"):
            raise KeyError(name)
        reply = self.request({"op": "lookup", "name": name})
        if "callable" in reply:
            value: Any = RemoteFunction(self.request, name, self.raised)
        elif "value" in reply:
            try:
                value = plain.decode(reply["value"])
            except ValueError:
                raise CandidateGone("runtime_error") from None
        else:
            raise KeyError(name)
        self[name] = value
        return value


@contextlib.contextmanager
def alarm(deadline: float) -> Iterator[None]:
    def fire(*_: Any) -> None:
        raise CheckTimeout

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(0.001, deadline - time.monotonic()))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_check(program: str, entry_point: str, request: Request,
              deadline: float) -> tuple[str, str]:
    """Run `check(<entry_point>)` from `program`; returns (outcome, error message).

    Raises CandidateGone when the candidate could not answer, and CheckTimeout
    at the deadline.
    """
    raised: set[int] = set()
    try:
        with alarm(deadline):
            namespace: dict[str, Any] = {"__name__": "__check__",
                                         "__builtins__": ProxyBuiltins(request, raised)}
            exec(compile(program, "assert_program.py", "exec", dont_inherit=True), namespace)
            namespace["check"](RemoteFunction(request, entry_point, raised))
    except (CandidateGone, CheckTimeout):
        raise
    except NotPlainResult as e:
        return "not_plain", str(e)
    except AssertionError as e:
        return "failed", f"AssertionError: {e}"[:1000]
    except BaseException as e:  # the check program's own error, or the candidate's
        by_candidate = any(id(x) in raised for x in (e, e.__context__, e.__cause__))
        return ("runtime_error" if by_candidate else "failed"), f"{type(e).__name__}: {e}"[:1000]
    return "ok", ""
