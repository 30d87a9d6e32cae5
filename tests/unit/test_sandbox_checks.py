"""How a candidate's exception reaches an assert program (reward_sandbox.assert_programs)."""

from services.reward_sandbox.assert_programs import _rebuild_exception


def test_a_candidate_exception_keeps_its_builtin_type_for_the_test() -> None:
    error = _rebuild_exception("ValueError", "bad input")
    assert type(error) is ValueError and str(error) == "bad input"


def test_exceptions_that_end_iteration_become_runtime_errors() -> None:
    # by name: a candidate's own class called StopIteration arrives the same way
    for name in ("StopIteration", "StopAsyncIteration"):
        error = _rebuild_exception(name, "wrong on purpose")
        assert type(error) is RuntimeError and name in str(error)


def test_unknown_or_fatal_names_become_runtime_errors() -> None:
    assert type(_rebuild_exception("MyError", "x")) is RuntimeError
    assert type(_rebuild_exception("SystemExit", "")) is RuntimeError
    assert type(_rebuild_exception("KeyboardInterrupt", "")) is RuntimeError
