"""RunsClient (sync and asyncio) against a scripted Learner servicer on loopback.

The servicer stands in for the learner only to pin down the client's side of
the contract: what it sends, how replies map to RunInfo/RunEvent, and which
gRPC codes become which Python exceptions (and CLI exit codes). The real
learner is exercised through the same client by the integration and container
tests.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from marl.cli import main as cli
from marl.clients import AsyncRunsClient, RunNotFound, RunsClient
from marl.clients.runs import LearnerUnavailable, RunRefused, spec_yaml
from marl.protocol.v1 import learner_pb2, learner_pb2_grpc
from marl.spec.run import parse_spec


class ScriptedLearner(learner_pb2_grpc.LearnerServicer):
    def __init__(self) -> None:
        self.specs: list[str] = []

    def _run(self, run_id: str, state: str = "RUNNING", step: int = 1) -> learner_pb2.Run:
        return learner_pb2.Run(
            run_id=run_id,
            state=state,
            step=step,
            total_steps=2,
            out_dir=f"/runs/{run_id}",
            last_metrics_json=json.dumps({"step": step}),
            created_at=5.0,
        )

    def SubmitRun(self, request: Any, context: Any) -> Any:
        spec = yaml.safe_load(request.spec_yaml)
        if spec.get("train", {}).get("steps") == 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "train.steps: must be >= 1")
        self.specs.append(request.spec_yaml)
        return learner_pb2.SubmitRunResponse(run_id=f"run-{len(self.specs)}")

    def GetRun(self, request: Any, context: Any) -> Any:
        if request.run_id == "stopping":  # as a learner that stops mid-call answers
            context.abort(grpc.StatusCode.CANCELLED, "Cancelled")
        if request.run_id != "run-1":
            context.abort(grpc.StatusCode.NOT_FOUND, f"no run {request.run_id!r}")
        return self._run("run-1")

    def ListRuns(self, request: Any, context: Any) -> Any:
        return learner_pb2.ListRunsResponse(
            runs=[self._run("run-1"), self._run("run-2", "QUEUED", 0)]
        )

    def CancelRun(self, request: Any, context: Any) -> Any:
        return self._run(request.run_id, "CANCELLED")

    def WatchRun(self, request: Any, context: Any) -> Iterator[Any]:
        start = 0 if request.from_start else 1
        for step in range(start, 2):
            if request.run_id == "stopping" and step == 1:
                context.abort(grpc.StatusCode.CANCELLED, "Cancelled")
            yield learner_pb2.RunEvent(
                metrics_json=json.dumps({"step": step, "loss": 0.5}),
                run=self._run(request.run_id, "RUNNING", step),
            )
        yield learner_pb2.RunEvent(run=self._run(request.run_id, "SUCCEEDED", 2))


@pytest.fixture()
def learner() -> Iterator[tuple[str, ScriptedLearner]]:
    servicer = ScriptedLearner()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    learner_pb2_grpc.add_LearnerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(0)


def _dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_sync_client_round_trip(learner: tuple[str, ScriptedLearner]) -> None:
    address, servicer = learner
    with RunsClient(address, timeout=10) as runs:
        assert runs.submit({"name": "x", "train": {"steps": 2}}) == "run-1"
        assert yaml.safe_load(servicer.specs[0]) == {"name": "x", "train": {"steps": 2}}
        run = runs.get("run-1")
        assert (run.state, run.step, run.total_steps, run.last_metrics) == (
            "RUNNING",
            1,
            2,
            {"step": 1},
        )
        assert not run.done and run.to_dict()["out_dir"] == "/runs/run-1"
        assert [r.run_id for r in runs.list()] == ["run-1", "run-2"]
        assert runs.cancel("run-1").state == "CANCELLED"
        events = list(runs.watch("run-1"))
        assert [e.metrics["step"] if e.metrics else None for e in events] == [0, 1, None]
        assert events[-1].run.done
        assert [e.metrics for e in runs.watch("run-1", from_start=False)][0] == {
            "step": 1,
            "loss": 0.5,
        }


def test_errors_become_python_exceptions(learner: tuple[str, ScriptedLearner]) -> None:
    address, _ = learner
    with RunsClient(address, timeout=10) as runs:
        with pytest.raises(RunRefused, match="train.steps"):
            runs.submit({"train": {"steps": 0}})
        with pytest.raises(ValueError):  # RunRefused is a ValueError for callers
            runs.submit({"train": {"steps": 0}})
        with pytest.raises(RunNotFound, match="nope"):
            runs.get("nope")
    with RunsClient(_dead_address(), timeout=5) as runs, pytest.raises(LearnerUnavailable):
        runs.list()


def test_a_learner_stopping_mid_call_is_unavailable(learner: tuple[str, ScriptedLearner]) -> None:
    address, _ = learner
    with RunsClient(address, timeout=10) as runs:
        with pytest.raises(LearnerUnavailable, match="stopped during the call"):
            runs.get("stopping")
        seen = []
        with pytest.raises(LearnerUnavailable, match="shutting down or restarting"):
            for event in runs.watch("stopping"):
                seen.append(event)
        assert len(seen) == 1
    assert cli.main(["status", "stopping", "--learner", address]) == 2


async def _aio_stopping(address: str) -> None:
    async with AsyncRunsClient(address, timeout=10) as runs:
        with pytest.raises(LearnerUnavailable, match="stopped during the call"):
            await runs.get("stopping")


def test_an_async_learner_stopping_mid_call_is_unavailable(
    learner: tuple[str, ScriptedLearner],
) -> None:
    asyncio.run(_aio_stopping(learner[0]))


def test_spec_forms(tmp_path: Path) -> None:
    spec = parse_spec({"name": "formats"})
    assert "name: formats" in spec_yaml(spec)
    path = tmp_path / "run.yaml"
    path.write_text("name: from-file\n")
    assert spec_yaml(str(path)) == "name: from-file\n"
    assert spec_yaml(path) == "name: from-file\n"
    assert spec_yaml("name: text\n") == "name: text\n"
    with pytest.raises(ValueError, match="does not exist"):
        spec_yaml(str(tmp_path / "missing.yaml"))


async def test_async_client_round_trip(learner: tuple[str, ScriptedLearner]) -> None:
    address, _ = learner
    async with AsyncRunsClient(address, timeout=10) as runs:
        assert await runs.submit("name: a\n") == "run-1"
        assert (await runs.get("run-1")).state == "RUNNING"
        assert len(await runs.list()) == 2
        assert (await runs.cancel("run-2")).state == "CANCELLED"
        steps = [e.metrics["step"] async for e in runs.watch("run-1") if e.metrics]
        assert steps == [0, 1]
        with pytest.raises(RunNotFound):
            await runs.get("other")


def test_cli_uses_the_client_and_exits_2_on_user_errors(
    learner: tuple[str, ScriptedLearner], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    address, _ = learner
    spec = tmp_path / "run.yaml"
    spec.write_text("name: cli\n")
    assert cli.main(["submit", str(spec), "--learner", address]) == 0
    assert capsys.readouterr().out.strip() == "run-1"
    assert cli.main(["status", "run-1", "--json", "--learner", address]) == 0
    assert json.loads(capsys.readouterr().out)["state"] == "RUNNING"
    assert cli.main(["status", "nope", "--learner", address]) == 2
    assert "no run 'nope'" in capsys.readouterr().err
    assert cli.main(["submit", str(spec), "train.steps=0", "--learner", address]) == 2
    assert "train.steps" in capsys.readouterr().err
    assert cli.main(["runs", "--learner", _dead_address()]) == 2
    assert "not reachable" in capsys.readouterr().err
