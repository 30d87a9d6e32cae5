"""The sandbox's own token in the typed settings (`marl.spec.services`) and the launcher's
environments: what a sandbox and its clients hold, and what they refuse to start with."""

from __future__ import annotations

from pathlib import Path

import pytest

from marl.local.launcher import sandbox_environment
from marl.spec.services import load_service_config, sandbox_token


def test_sandbox_token_from_the_variable_or_its_file(tmp_path: Path) -> None:
    assert sandbox_token({}) is None
    assert sandbox_token({"MARL_SANDBOX_TOKEN": "abc"}) == "abc"
    f = tmp_path / "token"
    f.write_text("from-file\n")
    assert sandbox_token({"MARL_SANDBOX_TOKEN_FILE": str(f)}) == "from-file"
    with pytest.raises(ValueError, match="MARL_SANDBOX_TOKEN_FILE: cannot read"):
        sandbox_token({"MARL_SANDBOX_TOKEN_FILE": str(tmp_path / "none")})
    with pytest.raises(ValueError, match="MARL_SANDBOX_TOKEN: the token must be"):
        sandbox_token({"MARL_SANDBOX_TOKEN": "has space"})


@pytest.mark.parametrize("name", ["MARL_AUTH_TOKEN", "MARL_AUTH_TOKEN_FILE",
                                  "MARL_AUTH_TOKENS_FILE"])
def test_deny_a_sandbox_holding_the_services_or_users_tokens(name: str) -> None:
    with pytest.raises(ValueError, match=f"^{name}: the sandbox must not hold"):
        load_service_config("sandbox", environ={name: "x", "MARL_SANDBOX_TOKEN": "own"})
    load_service_config("sandbox", environ={"MARL_SANDBOX_TOKEN": "own"})


def test_deny_a_sandbox_token_that_is_the_services() -> None:
    env = {"MARL_AUTH_TOKEN": "same", "MARL_SANDBOX_TOKEN": "same"}
    with pytest.raises(ValueError, match="MARL_SANDBOX_TOKEN: the sandbox's token is the"):
        load_service_config("workflow", environ=env)
    load_service_config("workflow", environ={**env, "MARL_SANDBOX_TOKEN": "other"})
    # the learner and inference never read it
    load_service_config("learner", environ=env)


def test_the_launcher_gives_the_sandbox_no_other_services_secrets() -> None:
    env = {"MARL_AUTH_TOKEN": "t", "MARL_AUTH_TOKEN_FILE": "/f", "MARL_AUTH_TOKENS_FILE": "/u",
           "MARL_WORKFLOW_REDIS": "redis://:t@h/0", "MARL_LEARNER_REDIS": "redis://:t@h/0",
           "MARL_INFERENCE_MODEL": "/m", "MARL_SANDBOX_ISOLATION": "seccomp",
           "MARL_SANDBOX_TOKEN_FILE": "/s", "MARL_TLS_CERT": "/c", "PATH": "/bin"}
    assert sandbox_environment(env) == {
        "MARL_SANDBOX_ISOLATION": "seccomp", "MARL_SANDBOX_TOKEN_FILE": "/s",
        "MARL_TLS_CERT": "/c", "PATH": "/bin"}
