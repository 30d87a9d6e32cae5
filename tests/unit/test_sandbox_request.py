"""Request validation (field-named errors), config loading and the client's request builder."""

from __future__ import annotations

from pathlib import Path

import pytest

from marl.clients.sandbox import build_request, default_deadline
from marl.spec.services import SandboxConfig
from marl.spec.services import load_sandbox as load_config
from services.reward_sandbox import jobspec

CFG = SandboxConfig()


def test_job_splits_public_secret_and_expected() -> None:
    req = build_request("def f(x): return x", [
        {"stdin": "1", "expected_stdout": "SECRET-OUT"},
        {"fn_name": "f", "args": [1], "expected": "SECRET-VALUE"},
        {"assert_program": "def check(c):\n    assert c(1) == 'SECRET-ASSERT'\n",
         "entry_point": "f"},
    ], limits={"timeout_seconds": 2})
    job = jobspec.parse(req, CFG)
    public = repr(job.public())
    assert "SECRET" not in public
    assert "SECRET-ASSERT" in repr(job.secrets())
    assert "SECRET-OUT" not in repr(job.secrets())
    assert "SECRET-VALUE" not in repr(job.secrets())
    assert job.expected == ["SECRET-OUT", "SECRET-VALUE", None]
    assert job.limits.timeout_seconds == 2
    assert job.limits.memory_bytes == CFG.default_memory_bytes


@pytest.mark.parametrize(("tests", "limits", "field"), [
    ([], None, "tests:"),
    ([{"fn_name": "f", "args": [], "expected": 1}], {"timeout_seconds": 1e9},
     "limits.timeout_seconds:"),
    ([{"fn_name": "f", "args": [], "expected": 1}], {"output_bytes": -5}, "limits.output_bytes:"),
    ([{"fn_name": "f", "args": [], "expected": 1}], {"memory_bytes": 1000},
     "limits.memory_bytes:"),
    ([{"fn_name": "1f", "args": [], "expected": 1}], None, "tests[0].function_call.fn_name:"),
    ([{"assert_program": "def check(:", "entry_point": "f"}], None,
     "tests[0].assert_program.assert_program:"),
    ([{"assert_program": "x = 1", "entry_point": "f"}], None,
     "tests[0].assert_program.assert_program:"),
    ([{"assert_program": "def check(c): pass", "entry_point": "a.b"}], None,
     "tests[0].assert_program.entry_point:"),
])
def test_bad_requests_name_the_field(tests: list, limits: dict | None, field: str) -> None:
    with pytest.raises(ValueError) as err:
        jobspec.parse(build_request("", tests, limits), CFG)
    assert str(err.value).startswith(field)


def test_code_size_is_bounded() -> None:
    cfg = SandboxConfig(max_code_bytes=1024)
    with pytest.raises(ValueError, match="^code:"):
        jobspec.parse(build_request("x" * 2000, [{"stdin": "", "expected_stdout": ""}]), cfg)


def test_client_builds_requests_and_deadlines() -> None:
    req = build_request("c", [{"fn_name": "f", "args": (1, [2]), "expected": {"a": None}}])
    assert req.tests[0].function_call.args_json == "[1, [2]]"
    assert req.tests[0].function_call.expected_json == '{"a": null}'
    assert default_deadline(req) > 5
    with pytest.raises(ValueError, match=r"tests\[0\]"):
        build_request("c", [{"fn_name": "f", "args": [object()], "expected": 1}])
    with pytest.raises(ValueError, match=r"tests\[0\]"):
        build_request("c", [{"stdin": "x"}])


def test_config_loads_and_names_bad_fields(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("max_concurrency: 3\nisolation: seccomp\n")
    cfg = load_config(str(good))
    assert cfg.max_concurrency == 3 and cfg.isolation == "seccomp"
    bad = tmp_path / "bad.yaml"
    bad.write_text("isolation: chroot\n")
    with pytest.raises(ValueError, match="^isolation:"):
        load_config(str(bad))
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("workers: 3\n")
    with pytest.raises(ValueError, match="^workers:"):
        load_config(str(unknown))
    with pytest.raises(ValueError, match="--config"):
        load_config(str(tmp_path / "missing.yaml"))
