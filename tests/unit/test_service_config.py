"""Typed service settings: defaults, YAML, MARL_* variables and flags, in that order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from marl.cli import main as cli
from marl.spec.services import (
    MODELS,
    SERVICES,
    InferenceConfig,
    env_name,
    load_service_config,
    load_workflow,
)


def test_defaults_match_what_the_servers_used_before() -> None:
    inf = load_service_config("inference", environ={})
    assert (inf.engine, inf.dtype, inf.retention, inf.max_lora_rank) == ("auto", "float32", 2, 64)
    assert inf.http_port is None and inf.host == "127.0.0.1" and inf.port == 0
    wf = load_service_config("workflow", environ={})
    assert wf.concurrency == 512 and wf.sandbox is None
    assert load_service_config("learner", environ={}).runs_dir == "runs"
    sb = load_service_config("sandbox", environ={})
    assert sb.isolation == "auto" and sb.http_port is None


def test_every_field_is_documented() -> None:
    for service in SERVICES:
        for name, field in MODELS[service].model_fields.items():
            assert field.description, f"{service}.{name} has no docstring"


def test_layers_file_then_env_then_flags(tmp_path: Path) -> None:
    f = tmp_path / "wf.yaml"
    f.write_text("concurrency: 8\nsandbox: sb:1\nport: 7000\n")
    env = {"MARL_WORKFLOW_CONCURRENCY": "16", "MARL_WORKFLOW_REDIS": "redis://r:6379/0"}
    cfg = load_service_config("workflow", str(f), {"port": 7100, "sandbox": None}, env)
    assert cfg.concurrency == 16  # env beats the file
    assert cfg.port == 7100  # a flag beats both
    assert cfg.sandbox == "sb:1"  # a flag left unset (None) does not erase the file's value
    assert cfg.redis == "redis://r:6379/0"


def test_env_names_and_other_switches_left_alone() -> None:
    assert env_name("sandbox", "max_concurrency") == "MARL_SANDBOX_MAX_CONCURRENCY"
    env = {"MARL_SANDBOX_SABOTAGE": "1", "MARL_SANDBOX_MAX_CONCURRENCY": "3"}
    assert load_service_config("sandbox", environ=env).max_concurrency == 3


def test_bad_file_value_names_field_and_file(tmp_path: Path) -> None:
    f = tmp_path / "inf.yaml"
    f.write_text("retention: lots\n")
    with pytest.raises(ValueError, match=rf"^retention: .*\(in {f}\)"):
        load_service_config("inference", str(f), environ={})
    f.write_text("max_lora_rank: 0\n")
    with pytest.raises(ValueError, match="^max_lora_rank: Input should be greater than or equal"):
        load_service_config("inference", str(f), environ={})


def test_replica_wait_must_stay_below_claim_idle(tmp_path: Path) -> None:
    f = tmp_path / "workflow.yaml"
    f.write_text("replica_wait_s: 150\n")
    with pytest.raises(ValueError, match=r"^replica_wait_s \(150\) must be below claim_idle_s \(120\)"):
        load_service_config("workflow", str(f), environ={})
    cfg = load_service_config("workflow", str(f), environ={"MARL_WORKFLOW_CLAIM_IDLE_S": "300"})
    assert (cfg.replica_wait_s, cfg.claim_idle_s) == (150, 300)


def test_unknown_key_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "learner.yaml"
    f.write_text("runs_dir: /data\nworkers: 3\n")
    with pytest.raises(ValueError, match="^workers: Extra inputs are not permitted"):
        load_service_config("learner", str(f), environ={})


def test_bad_env_value_names_the_variable() -> None:
    with pytest.raises(ValueError, match=r"^engine: .*\(from MARL_INFERENCE_ENGINE\)"):
        load_service_config("inference", environ={"MARL_INFERENCE_ENGINE": "tgi"})


def test_not_a_mapping_or_missing(tmp_path: Path) -> None:
    f = tmp_path / "list.yaml"
    f.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="must hold a mapping"):
        load_workflow(str(f))
    with pytest.raises(ValueError, match="--config: cannot read"):
        load_workflow(str(tmp_path / "nope.yaml"))


def test_sandbox_module_uses_the_same_model() -> None:
    from marl.spec.services import SandboxConfig
    from marl.spec.services import load_sandbox as load_config

    assert SandboxConfig is MODELS["sandbox"]
    assert isinstance(load_config(None), SandboxConfig)


def test_http_port_field_exists_for_inference_and_sandbox() -> None:
    assert InferenceConfig(http_port=8000).http_port == 8000
    with pytest.raises(ValueError):
        InferenceConfig(http_port=70000)
    assert (
        load_service_config("sandbox", overrides={"http_port": 8080}, environ={}).http_port == 8080
    )


def test_cli_serve_bad_config_exits_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "wf.yaml"
    f.write_text("redis: redis://x\nconcurrency: -1\n")
    assert cli.main(["serve", "workflow", "--config", str(f)]) == 2
    assert "concurrency:" in capsys.readouterr().err


def test_cli_serve_needs_redis(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("MARL_LEARNER_REDIS", raising=False)
    assert cli.main(["serve", "learner"]) == 2
    assert "--redis URL is required" in capsys.readouterr().err


def test_auth_token_from_the_environment_or_a_file(tmp_path: Path) -> None:
    from marl.spec.services import auth_token

    assert auth_token({}) is None
    assert auth_token({"MARL_AUTH_TOKEN": ""}) is None  # set but empty: off
    assert auth_token({"MARL_AUTH_TOKEN": "abc"}) == "abc"
    secret = tmp_path / "token"
    secret.write_text("from-file\n")  # a mounted Secret often ends in a newline
    assert auth_token({"MARL_AUTH_TOKEN_FILE": str(secret)}) == "from-file"
    assert auth_token({"MARL_AUTH_TOKEN": "env", "MARL_AUTH_TOKEN_FILE": str(secret)}) == "env"
    with pytest.raises(ValueError, match="MARL_AUTH_TOKEN_FILE: cannot read"):
        auth_token({"MARL_AUTH_TOKEN_FILE": str(tmp_path / "missing")})
    with pytest.raises(ValueError, match="MARL_AUTH_TOKEN: the token must be"):
        auth_token({"MARL_AUTH_TOKEN": "two words"})


def test_tls_files_both_or_neither_and_readable(tmp_path: Path) -> None:
    from marl.spec.services import tls_files

    assert tls_files({}) == {}
    cert = tmp_path / "cert.pem"
    cert.write_bytes(b"PEM")
    assert tls_files({"MARL_TLS_CA": str(cert)}) == {"ca": b"PEM"}
    assert tls_files({"MARL_TLS_CERT": str(cert), "MARL_TLS_KEY": str(cert)}) == {
        "cert": b"PEM", "key": b"PEM"}
    with pytest.raises(ValueError, match="set both"):
        tls_files({"MARL_TLS_CERT": str(cert)})
    with pytest.raises(ValueError, match="MARL_TLS_KEY: cannot read"):
        tls_files({"MARL_TLS_CERT": str(cert), "MARL_TLS_KEY": str(tmp_path / "nope")})


def test_marl_serve_with_a_bad_token_or_tls_file_exits_2(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MARL_AUTH_TOKEN", "has spaces")
    assert cli.main(["serve", "sandbox", "--port", "0"]) == 2
    assert "MARL_AUTH_TOKEN" in capsys.readouterr().err
    monkeypatch.delenv("MARL_AUTH_TOKEN")
    monkeypatch.setenv("MARL_TLS_CERT", "/no/such/cert.pem")
    assert cli.main(["serve", "sandbox", "--port", "0"]) == 2
    assert "MARL_TLS_CERT: cannot read" in capsys.readouterr().err


def test_trace_dir_from_the_config_file_or_the_environment_turns_tracing_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the chart's `<service>.config.trace_dir` reaches: `marl serve` traces into it,
    as with `--trace-dir`."""
    from marl.runtime import tracing
    from services.learner import server as learner

    started: list[bool] = []
    monkeypatch.setattr(learner, "run", lambda *a, **k: started.append(tracing.tracer().on))
    f = tmp_path / "learner.yaml"
    f.write_text(f"redis: redis://127.0.0.1:1\ntrace_dir: {tmp_path / 'from-file'}\n")
    try:
        assert cli.main(["serve", "learner", "--config", str(f)]) == 0
        assert list((tmp_path / "from-file").glob("learner-*.jsonl"))
        monkeypatch.setenv("MARL_LEARNER_TRACE_DIR", str(tmp_path / "from-env"))
        assert cli.main(["serve", "learner", "--config", str(f)]) == 0
        assert list((tmp_path / "from-env").glob("learner-*.jsonl"))
        assert started == [True, True]
    finally:
        tracing.configure("test", None)


def test_cli_serve_flags_beat_the_environment_and_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every field is a flag of `marl serve` (made from the model), layered last."""
    from services.inference import server as inference
    from services.workflow import server as workflow

    started: list[Any] = []
    monkeypatch.setattr(workflow, "run", started.append)
    monkeypatch.setattr(inference, "run", started.append)
    f = tmp_path / "wf.yaml"
    f.write_text("redis: redis://x\nconcurrency: 8\nsandbox: sb:1\n")
    monkeypatch.setenv("MARL_WORKFLOW_CONCURRENCY", "16")
    monkeypatch.setenv("MARL_WORKFLOW_DRAIN_S", "3")
    argv = ["serve", "workflow", "--config", str(f), "--concurrency", "9", "--replica-wait-s", "5"]
    assert cli.main(argv) == 0
    cfg = started.pop()
    assert (cfg.concurrency, cfg.sandbox, cfg.drain_s, cfg.replica_wait_s) == (9, "sb:1", 3.0, 5.0)
    argv = ["serve", "inference", "--redis", "redis://x", "--model", "m", "--enforce-eager",
            "--gpu-memory-utilization", "0.4", "--engine", "transformers"]
    assert cli.main(argv) == 0
    cfg = started.pop()
    assert (cfg.enforce_eager, cfg.gpu_memory_utilization, cfg.engine) == (True, 0.4, "transformers")


def test_cli_serve_refuses_another_services_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "learner", "--redis", "redis://x", "--model", "m"])
    assert exit_.value.code == 2 and "--model" in capsys.readouterr().err
