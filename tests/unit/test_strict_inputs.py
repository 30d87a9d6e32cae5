"""Strict inputs (issue 70): a tagged YAML value that cannot be converted, a JSON document
nested 100,000 deep, NaN/infinite bounds and booleans given for numbers are each refused
with a ValueError naming the field (and the limit), never a raw ValueError, RecursionError
or a silently accepted value."""

from __future__ import annotations

import asyncio
import json
import math
import re
from typing import Any

import pytest

from marl.clients.sandbox import build_request
from marl.spec.run import SpecError, load_spec_text, parse_spec
from marl.spec.safe_input import load_yaml
from marl.spec.services import SandboxConfig
from services.reward_sandbox import http_api, jobspec

CFG = SandboxConfig()
DEEP = 100_000


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("a: !!int x", "`a`"),
        ("a: {b: [1, !!int 0x]}", "`a.b[1]`"),
        ("a: 1\nb: !!float q", "`b`"),
        ("a: !!bool maybe", "`a`"),
        ("a: !!timestamp x", "`a`"),
    ],
)
def test_yaml_tag_with_a_bad_value_names_the_field(text: str, field: str) -> None:
    with pytest.raises(ValueError, match=f"field {re.escape(field)}: .* is not a valid !!"):
        load_yaml(text, "the spec")


def test_run_spec_with_a_bad_tagged_value_is_a_spec_error() -> None:
    with pytest.raises(SpecError, match="field `train.steps`: 'x' is not a valid !!int value"):
        load_spec_text("train:\n  steps: !!int x\n")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"train": {"checkpoint_interval": True}}, "train.checkpoint_interval"),
        ({"seed": False}, "seed"),
        ({"sampling": {"max_tokens": True}}, "sampling.max_tokens"),
        ({"optim": {"lr": True}}, "optim.lr"),
        ({"optim": {"betas": [True, 0.9]}}, "optim.betas"),
        ({"optim": {"policy_lr": {"generator": True}}}, "optim.policy_lr"),
    ],
)
def test_run_spec_refuses_booleans_for_numbers(change: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError, match=f"field `{field}`: .*not (a )?boolean"):
        parse_spec(change)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize(
    "field", ["train.step_timeout_s", "optim.lr", "lora.alpha", "sampling.temperature"]
)
def test_run_spec_refuses_nan_and_infinity(field: str, value: float) -> None:
    section, name = field.split(".")
    with pytest.raises(SpecError, match=f"field `{field}`: .*finite"):
        parse_spec({section: {name: value}})


def test_run_spec_still_takes_booleans_where_they_belong() -> None:
    spec = parse_spec(
        {
            "model": {"chat_template": False},
            "sampling": {"max_tokens": None},
            "train": {"checkpoint_interval": 2},
        }
    )
    assert spec.model.chat_template is False and spec.train.checkpoint_interval == 2


def _call(
    args_json: str = "[1]", expected_json: str = "1", limits: dict[str, Any] | None = None
) -> jobspec.Job:
    req = build_request(
        "def f(x): return x", [{"fn_name": "f", "args": [1], "expected": 1}], limits
    )
    req.tests[0].function_call.args_json = args_json
    req.tests[0].function_call.expected_json = expected_json
    return jobspec.parse(req, CFG)


@pytest.mark.parametrize(
    ("args", "expected", "field"),
    [
        ("[" * DEEP + "]" * DEEP, "1", "args_json"),
        ('{"a":' * DEEP + "1" + "}" * DEEP, "1", "args_json"),
        ("[1]", "[" * DEEP, "expected_json"),
        ("[" * 101 + "]" * 101, "1", "args_json"),
    ],
)
def test_sandbox_refuses_json_nested_past_the_cap(args: str, expected: str, field: str) -> None:
    with pytest.raises(
        ValueError,
        match=(
            rf"^tests\[0\]\.function_call\.{field}: nested more than "
            rf"{jobspec.MAX_JSON_DEPTH} .*the limit is {jobspec.MAX_JSON_DEPTH}"
        ),
    ):
        _call(args, expected)


def test_sandbox_takes_json_nested_up_to_the_cap() -> None:
    depth = jobspec.MAX_JSON_DEPTH
    job = _call("[" * depth + "]" * depth)
    assert job.tests[0]["args"] == json.loads("[" * depth + "]" * depth)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_sandbox_refuses_non_finite_limits(value: float) -> None:
    with pytest.raises(ValueError, match="^limits.timeout_seconds: must be a finite number"):
        _call(limits={"timeout_seconds": value})


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("run_timeout", math.nan, "must be a finite number"),
        ("run_timeout", math.inf, "must be a finite number"),
        ("memory_limit_MB", math.nan, "must be a finite number"),
        ("run_timeout", True, "must be a number"),
        ("memory_limit_MB", False, "must be a number"),
    ],
)
def test_sandbox_http_request_is_strict_about_numbers(field: str, value: Any, why: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}: {why}"):
        http_api.parse_request({"language": "python", "code": "", field: value}, 1 << 20)


def test_http_body_nested_past_the_cap_is_named() -> None:
    from aiohttp.test_utils import make_mocked_request
    from aiohttp.web import Request

    from marl.runtime.http_server import MAX_BODY_DEPTH, read_json_object

    async def parse(text: str) -> Any:
        req: Request = make_mocked_request("POST", "/run_code")
        req._read_bytes = text.encode()  # what aiohttp caches after reading the body
        return await read_json_object(req)

    for text in [
        '{"a": ' + "[" * DEEP + "]" * DEEP + "}",
        '{"a": ' + "[" * (MAX_BODY_DEPTH) + "]" * MAX_BODY_DEPTH + "}",
    ]:
        with pytest.raises(ValueError, match=f"^body: nested more than {MAX_BODY_DEPTH}"):
            asyncio.run(parse(text))
    assert asyncio.run(parse('{"a": [[1]]}')) == {"a": [[1]]}
