"""Plain-value transfer and the judge's comparison rules."""

from __future__ import annotations

import math

import pytest

from services.reward_sandbox import plain, verdicts


@pytest.mark.parametrize("value", [
    None, True, 0, -7, 10**5000, 1.5, -0.0, "x\u00e9", b"\x00\xff", [1, [2]], (1, (2,)),
    {1, 2}, frozenset({"a"}), {"a": 1, 2: [3], (1, 2): None}, 1 + 2j, [], {}, (),
], ids=lambda v: type(v).__name__)
def test_plain_round_trip(value: object) -> None:
    back = plain.loads(plain.dumps(value))
    assert back == value and type(back) is type(value)


def test_plain_round_trip_nan_and_inf() -> None:
    back = plain.loads(plain.dumps([math.nan, math.inf, -math.inf]))
    assert math.isnan(back[0]) and back[1:] == [math.inf, -math.inf]


class AlwaysEqual:
    def __eq__(self, other: object) -> bool:
        return True


class MyInt(int):
    pass


@pytest.mark.parametrize("value", [AlwaysEqual(), MyInt(3), [1, AlwaysEqual()], {"k": object()},
                                   iter([1]), lambda: 1])
def test_plain_refuses_everything_else(value: object) -> None:
    with pytest.raises(plain.NotPlain):
        plain.encode(value)


@pytest.mark.parametrize("data", [{"x": 1}, {"t": 1}, {"d": [[[1], 2]]}, {"s": [[1]]},
                                  {"F": "1.0"}, {"c": ["a", 1]}, {"b": "!!"}])
def test_plain_decode_rejects_malformed(data: object) -> None:
    with pytest.raises(ValueError):
        plain.decode(data)


def test_plain_decode_depth_is_bounded() -> None:
    deep: list[object] = []
    for _ in range(plain.MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(ValueError):
        plain.decode(deep)


@pytest.mark.parametrize(("actual", "expected", "same"), [
    ("1 2\n", "1 2", True),
    ("1 2   \r\n3\n\n\n", "1 2\n3", True),
    ("1 2", " 1 2", False),
    ("a\n\nb", "a\nb", False),
    ("A", "a", False),
    ("", "\n", True),
])
def test_stdout_judge_rules(actual: str, expected: str, same: bool) -> None:
    assert verdicts.stdout_matches(actual, expected) is same


@pytest.mark.parametrize(("got", "expected", "same"), [
    ((1, 2), [1, 2], True),
    ({1: "a"}, {"1": "a"}, True),
    (True, 1, False),
    (1, True, False),
    (0.1 + 0.2, 0.3, True),
    (1, 1.0, True),
    (3, 4, False),
    (math.nan, math.nan, True),
    ({1, 2}, [1, 2], False),
    ("1", 1, False),
    ([1, [2, 3]], [1, [2, 3]], True),
    ({"a": 1}, {"a": 1, "b": 2}, False),
])
def test_value_judge_rules(got: object, expected: object, same: bool) -> None:
    assert verdicts.values_equal(got, expected) is same


def test_verdict_maps_outcomes() -> None:
    assert verdicts.verdict("stdio", "ok", stdout="1\n", expected_stdout="1") == "PASSED"
    assert verdicts.verdict("call", "ok", value=2, expected=3) == "FAILED"
    assert verdicts.verdict("assert", "ok") == "PASSED"
    assert verdicts.verdict("assert", "timeout") == "TIMEOUT"
    assert verdicts.verdict("call", "not_plain") == "FAILED"
    assert verdicts.verdict("stdio", "something new") == "SANDBOX_ERROR"


@pytest.mark.parametrize(("got", "expected"), [
    (10**400, 1.5), (1.5, 10**400), (-(10**400), float("-inf")), ([10**400], [0.5]),
    ({"a": 10**309}, {"a": 1e308}),
])
def test_value_judge_gives_a_verdict_for_ints_past_float_range(got: object,
                                                               expected: object) -> None:
    assert verdicts.values_equal(got, expected) is False
    assert verdicts.verdict("call", "ok", value=got, expected=expected) == "FAILED"


def test_value_judge_fails_a_nesting_too_deep_to_compare() -> None:
    deep: list[object] = []
    for _ in range(100_000):
        deep = [deep]
    assert verdicts.values_equal(deep, [[]]) is False
