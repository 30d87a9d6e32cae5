"""The reward sandbox holds a token of its own and never the services' token.

A real local cluster runs with only the services' token in `$MARL_AUTH_TOKEN`: the
launcher makes the sandbox's own token (a 0600 file it lists in endpoints.json) and gives
it to the sandbox and the workflow workers, and takes the services' token out of the
sandbox's environment. The sandbox answers the services' token UNAUTHENTICATED (gRPC)
and 401 (HTTP) and accepts its own; `marl sandbox run` and `SandboxClient` send it; a
worker holding it scores code episodes (the sandbox counts their verdicts); and a sandbox
started with the services' token in its environment refuses to start.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
import requests

import marl
from marl.cli import main as cli
from marl.clients.runs import RunsClient
from marl.clients.sandbox import SandboxClient, build_request
from marl.local.demo import DEMO_SPEC
from marl.protocol.v1 import sandbox_pb2, sandbox_pb2_grpc
from marl.spec.run import apply_overrides, dump_spec, parse_spec

TOKEN = "services-token-for-the-sandbox-test"
pytestmark = [pytest.mark.timeout(600), pytest.mark.cluster(env={"MARL_AUTH_TOKEN": TOKEN})]
PROGRAM = "print(int(input()) * 2)"
TEST = [{"stdin": "21\n", "expected_stdout": "42\n"}]
WORKFLOW = "tests.integration.sandbox_workflows:CODE_ANSWER"


def own_token(endpoints: dict[str, Any]) -> str:
    return Path(endpoints["sandbox_token_file"]).read_text().strip()


def bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(e.decode().split("=", 1) for e in raw.split(b"\0") if b"=" in e)


def verdicts(endpoints: dict[str, Any]) -> float:
    (url,) = endpoints["metrics"]["sandbox"]
    return sum(float(line.rsplit(" ", 1)[1])
               for line in requests.get(url, timeout=10).text.splitlines()
               if line.startswith("marl_sandbox_verdicts_total{"))


def test_the_sandbox_token_is_made_for_the_cluster_and_kept_private(
        endpoints: dict[str, Any]) -> None:
    path = Path(endpoints["sandbox_token_file"])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(own_token(endpoints)) >= 32 and own_token(endpoints) != TOKEN


def test_deny_the_services_token_at_the_sandbox_and_accept_its_own(
        endpoints: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    request = build_request(PROGRAM, TEST, None)
    with grpc.insecure_channel(endpoints["sandbox"][0]) as channel:
        stub = sandbox_pb2_grpc.SandboxStub(channel)
        for rpc, req in ((stub.Execute, request), (stub.Info, sandbox_pb2.InfoRequest())):
            with pytest.raises(grpc.RpcError) as err:
                rpc(req, metadata=bearer(TOKEN), timeout=30)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        done = stub.Execute(request, metadata=bearer(own_token(endpoints)), timeout=60)
        assert done.pass_rate == 1.0
    (http,) = endpoints["sandbox_http"]
    body = {"code": "print(1)", "language": "python"}
    shared = requests.post(f"http://{http}/run_code", json=body, timeout=30,
                           headers={"Authorization": f"Bearer {TOKEN}"})
    assert shared.status_code == 401
    own = requests.post(f"http://{http}/run_code", json=body, timeout=60,
                        headers={"Authorization": f"Bearer {own_token(endpoints)}"})
    assert own.ok and own.json()["status"] == "Success"
    # marl's client sends the sandbox's token from the environment, never the services'
    with SandboxClient(endpoints["sandbox"][0]) as client, pytest.raises(grpc.RpcError) as err:
        client.execute(PROGRAM, TEST, timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    monkeypatch.setenv("MARL_SANDBOX_TOKEN_FILE", endpoints["sandbox_token_file"])
    with SandboxClient(endpoints["sandbox"][0]) as client:
        assert client.execute(PROGRAM, TEST).pass_rate == 1.0


def test_the_sandbox_process_holds_no_services_token(endpoints: dict[str, Any]) -> None:
    (pid,) = endpoints["pids"]["sandbox"]
    try:
        env = environ_of(pid)
    except PermissionError:
        pytest.skip("the sandbox is not dumpable and this test is not root")
    assert not [k for k in env if k.startswith("MARL_AUTH")]
    assert TOKEN not in "\0".join(f"{k}={v}" for k, v in env.items())
    assert env["MARL_SANDBOX_TOKEN_FILE"] == endpoints["sandbox_token_file"]
    for kind in ("learner", "inference"):  # the sandbox's clients only hold its token
        for other in endpoints["pids"][kind]:
            assert "MARL_SANDBOX_TOKEN_FILE" not in environ_of(other), kind
    (worker,) = endpoints["pids"]["workflow"]
    assert environ_of(worker)["MARL_SANDBOX_TOKEN_FILE"] == endpoints["sandbox_token_file"]


def test_marl_sandbox_run_sends_the_token_marl_up_listed(
        endpoints: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "marl-up").mkdir()
    (tmp_path / "marl-up" / "endpoints.json").write_text(json.dumps(endpoints))
    (tmp_path / "double.py").write_text(PROGRAM)
    (tmp_path / "in.txt").write_text("21\n")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["sandbox", "run", "double.py", "--stdin", "in.txt"]) == 0
    assert capsys.readouterr().out == "42\n"
    listed = {**endpoints, "sandbox_token_file": None}
    (tmp_path / "marl-up" / "endpoints.json").write_text(json.dumps(listed))
    assert cli.main(["sandbox", "run", "double.py", "--stdin", "in.txt"]) == 2
    assert "401" in capsys.readouterr().err  # the services' token is not the sandbox's


def test_allow_a_worker_with_the_sandbox_token_to_score_code_episodes(
        endpoints: dict[str, Any], tmp_path: Path) -> None:
    before = verdicts(endpoints)
    data = apply_overrides(DEMO_SPEC, [
        "train.steps=1", "train.problems_per_step=2", "grpo.group_size=2",
        "train.val_problems=1", "train.val_interval=1000", "train.step_timeout_s=180",
        "data.train=humaneval", "data.val=humaneval", "sampling.max_tokens=8",
        f"workflow={WORKFLOW}"])
    spec = parse_spec(data)
    spec.model.path = str(Path(marl.__file__).parent / "assets" / "demo-model")
    spec.out_dir = str(tmp_path / "run")
    with RunsClient(endpoints["learner"], timeout=30) as runs:
        run = runs.wait(runs.submit(dump_spec(spec)), timeout=300)
    assert run.state == "SUCCEEDED", run
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines()]
    assert rows[-1]["step"] == 1 and rows[-1]["train/episode_errors"] == 0
    # every episode of the step (2 problems x 2 samples) ran its tests in the sandbox
    assert verdicts(endpoints) >= before + 4


def test_deny_a_sandbox_started_with_the_services_token(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    bare = {k: v for k, v in os.environ.items() if not k.startswith("MARL_AUTH")}
    for name, value in (("MARL_AUTH_TOKEN", TOKEN), ("MARL_AUTH_TOKEN_FILE", str(token_file)),
                        ("MARL_AUTH_TOKENS_FILE", str(token_file))):
        done = subprocess.run(
            [sys.executable, "-m", "marl.cli", "serve", "sandbox", "--port", "0"],
            env={**bare, "MARL_SANDBOX_TOKEN": "the-sandbox-own", name: value},
            capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert name in done.stderr and "MARL_SANDBOX_TOKEN" in done.stderr
