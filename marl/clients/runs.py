"""Clients for the learner's Runs API (`marl serve learner`), sync and asyncio.

    from marl.clients import RunsClient

    with RunsClient("127.0.0.1:50051") as runs:
        run_id = runs.submit("examples/voting_math.yaml")   # a path, YAML text, dict or RunSpec
        for event in runs.watch(run_id):
            print(event.run.step, event.metrics)
        print(runs.get(run_id).state)                         # SUCCEEDED
        for run in runs.list():                               # every run you may see
            print(run.run_id, run.owner)

This is what `marl submit/status/runs/cancel` use. Errors come back as Python
exceptions a caller can act on: a bad spec is a `ValueError` naming the field
(`RunRefused`: INVALID_ARGUMENT or FAILED_PRECONDITION from the learner), an
unknown run a `RunNotFound` (a LookupError), an unreachable learner a
`LearnerUnavailable` (a ConnectionError; also a learner that stops during the call,
which gRPC answers CANCELLED);
anything else stays a `grpc.RpcError`. Every call has a deadline (`timeout`
seconds); a watch lasts as long as the run, so its default deadline is a day.
"""

from __future__ import annotations

import asyncio
import builtins
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from marl.protocol.rpc_codes import SERVER_GONE
from marl.protocol.v1 import learner_pb2, learner_pb2_grpc
from marl.runtime import auth
from marl.spec.services import LOCAL_LEARNER

TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
WATCH_TIMEOUT_S = 86_400.0


class RunNotFound(LookupError):
    """The learner knows no run by that id."""


class RunRefused(ValueError):
    """The learner refused the request (a bad spec names its field)."""


class LearnerUnavailable(ConnectionError):
    """Nothing answers at the learner's address."""


@dataclass(frozen=True)
class RunInfo:
    run_id: str
    state: str
    """QUEUED, RUNNING, SUCCEEDED, FAILED or CANCELLED."""
    step: int
    total_steps: int
    out_dir: str
    error: str
    last_metrics: dict[str, Any] | None
    created_at: float
    spec_yaml: str
    alarms: tuple[str, ...] = ()
    """Every role drift alarm and guard action of the run so far, "step N: ..."."""
    dead_lettered: int = 0
    """Tasks that failed `max_deliveries` times and were left out of their step."""
    duplicate_rollouts: int = 0
    """Rollouts that arrived a second time (a task re-run after its worker died) and were
    dropped."""
    steps_done: int = 0
    """Training steps logged so far."""
    failed_steps: int = 0
    """Of them, steps that lost more than `train.max_failed_fraction` of their episodes."""
    episodes: int = 0
    """Training episodes gathered so far, failed ones included."""
    failed_episodes: int = 0
    """Of them, episodes returned failed (no replica, sandbox down, dead-lettered, ...)."""
    owner: str = ""
    """The user who submitted it ("anonymous" while authentication is off)."""

    @property
    def done(self) -> bool:
        return self.state in TERMINAL

    @classmethod
    def from_proto(cls, run: learner_pb2.Run) -> RunInfo:
        return cls(
            run_id=run.run_id,
            state=run.state,
            step=run.step,
            total_steps=run.total_steps,
            out_dir=run.out_dir,
            error=run.error,
            last_metrics=json.loads(run.last_metrics_json) if run.last_metrics_json else None,
            created_at=run.created_at,
            spec_yaml=run.spec_yaml,
            alarms=tuple(run.alarms),
            dead_lettered=run.dead_lettered,
            duplicate_rollouts=run.duplicate_rollouts,
            steps_done=run.steps_done,
            failed_steps=run.failed_steps,
            episodes=run.episodes,
            failed_episodes=run.failed_episodes,
            owner=run.owner,
        )

    def to_dict(self) -> dict[str, Any]:
        """The fields `marl status --json` prints."""
        return {
            "run_id": self.run_id,
            "state": self.state,
            "step": self.step,
            "total_steps": self.total_steps,
            "out_dir": self.out_dir,
            "error": self.error,
            "last_metrics": self.last_metrics,
            "alarms": list(self.alarms),
            "dead_lettered": self.dead_lettered,
            "duplicate_rollouts": self.duplicate_rollouts,
            "steps_done": self.steps_done,
            "failed_steps": self.failed_steps,
            "episodes": self.episodes,
            "failed_episodes": self.failed_episodes,
            "owner": self.owner,
        }


@dataclass(frozen=True)
class RunEvent:
    metrics: dict[str, Any] | None
    """One metrics.jsonl row, or None for a state change without a step."""
    run: RunInfo


def spec_yaml(spec: Any) -> str:
    """A RunSpec, a dict, YAML/JSON text or a path to a spec file, as the YAML SubmitRun takes."""
    import yaml

    from marl.spec.run import RunSpec, dump_spec

    if isinstance(spec, RunSpec):
        return dump_spec(spec)
    if isinstance(spec, dict):
        return yaml.safe_dump(spec, sort_keys=False)
    if isinstance(spec, Path) or (
        isinstance(spec, str) and "\n" not in spec and spec.endswith((".yaml", ".yml", ".json"))
    ):
        path = Path(spec)
        if not path.is_file():
            raise ValueError(f"spec file {str(spec)!r} does not exist")
        return path.read_text()
    if isinstance(spec, str):
        return spec
    raise TypeError(f"spec: expected a RunSpec, dict, YAML text or path, not {type(spec).__name__}")


def _translate(err: grpc.RpcError, address: str) -> Exception:
    code = err.code()
    details = err.details() or code.name
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
        return RunRefused(details)
    if code == grpc.StatusCode.NOT_FOUND:
        return RunNotFound(details)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return RunRefused(f"the learner at {address} requires a token: {details}")
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return RunRefused(f"the learner at {address} refused this token: {details}")
    if code in SERVER_GONE:
        # CANCELLED is never this client's own cancel: a blocking call cannot be cancelled
        # by its caller, a watch's caller stops by leaving the loop, an asyncio caller's
        # cancel raises CancelledError
        how = "is not reachable" if code == grpc.StatusCode.UNAVAILABLE else (
            "stopped during the call: it is shutting down or restarting"
        )
        return LearnerUnavailable(
            f"the learner at {address} {how} ({details}); start it (or wait for it to be back) "
            "or pass --learner"
        )
    return err


class RunsClient:
    """Blocking client; one channel, closed by `close()` or the `with` block."""

    def __init__(self, address: str = LOCAL_LEARNER, timeout: float = 60.0):
        self.address = address
        self.timeout = timeout
        self._channel = auth.channel(address)
        self.stub = learner_pb2_grpc.LearnerStub(self._channel)

    def __enter__(self) -> RunsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: Any, request: Any) -> Any:
        try:
            return method(request, timeout=self.timeout)
        except grpc.RpcError as err:
            raise _translate(err, self.address) from None

    def submit(self, spec: Any) -> str:
        """Queue a run; returns its id."""
        request = learner_pb2.SubmitRunRequest(spec_yaml=spec_yaml(spec))
        return str(self._call(self.stub.SubmitRun, request).run_id)

    def get(self, run_id: str) -> RunInfo:
        return RunInfo.from_proto(
            self._call(self.stub.GetRun, learner_pb2.GetRunRequest(run_id=run_id))
        )

    def list(self, page_size: int = 0) -> builtins.list[RunInfo]:
        """Every run the caller may see (its own; all for an admin), oldest first."""
        return [run for page in self.pages(page_size) for run in page]

    def pages(self, page_size: int = 0) -> Iterator[builtins.list[RunInfo]]:
        """The runs the caller may see, a ListRuns page at a time (`page_size` runs at
        most; 0: the learner's default)."""
        token = ""
        while True:
            request = learner_pb2.ListRunsRequest(page_size=page_size, page_token=token)
            resp = self._call(self.stub.ListRuns, request)
            yield [RunInfo.from_proto(r) for r in resp.runs]
            token = resp.next_page_token
            if not token:
                return

    def cancel(self, run_id: str) -> RunInfo:
        request = learner_pb2.CancelRunRequest(run_id=run_id)
        return RunInfo.from_proto(self._call(self.stub.CancelRun, request))

    def watch(
        self, run_id: str, from_start: bool = True, timeout: float = WATCH_TIMEOUT_S
    ) -> Iterator[RunEvent]:
        """Every metrics row as it lands (from step 0 if `from_start`), until the run ends."""
        request = learner_pb2.WatchRunRequest(run_id=run_id, from_start=from_start)
        try:
            for event in self.stub.WatchRun(request, timeout=timeout):
                yield _event(event)
        except grpc.RpcError as err:
            raise _translate(err, self.address) from None

    def wait(self, run_id: str, timeout: float = 3600.0, poll_s: float = 1.0) -> RunInfo:
        """Poll until the run reaches a terminal state; TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            run = self.get(run_id)
            if run.done:
                return run
            if time.monotonic() > deadline:
                raise TimeoutError(f"run {run_id} still {run.state} after {timeout:.0f}s")
            time.sleep(poll_s)


class AsyncRunsClient:
    """asyncio client (grpc.aio); use `async with`."""

    def __init__(self, address: str = LOCAL_LEARNER, timeout: float = 60.0):
        self.address = address
        self.timeout = timeout
        self._channel = auth.aio_channel(address)
        self.stub = learner_pb2_grpc.LearnerStub(self._channel)

    async def __aenter__(self) -> AsyncRunsClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, method: Any, request: Any) -> Any:
        try:
            return await method(request, timeout=self.timeout)
        except grpc.RpcError as err:
            raise _translate(err, self.address) from None

    async def submit(self, spec: Any) -> str:
        request = learner_pb2.SubmitRunRequest(spec_yaml=spec_yaml(spec))
        return str((await self._call(self.stub.SubmitRun, request)).run_id)

    async def get(self, run_id: str) -> RunInfo:
        request = learner_pb2.GetRunRequest(run_id=run_id)
        return RunInfo.from_proto(await self._call(self.stub.GetRun, request))

    async def list(self, page_size: int = 0) -> builtins.list[RunInfo]:
        """Every run the caller may see (its own; all for an admin), oldest first."""
        return [run async for page in self.pages(page_size) for run in page]

    async def pages(self, page_size: int = 0) -> AsyncIterator[builtins.list[RunInfo]]:
        """The runs the caller may see, a ListRuns page at a time."""
        token = ""
        while True:
            request = learner_pb2.ListRunsRequest(page_size=page_size, page_token=token)
            resp = await self._call(self.stub.ListRuns, request)
            yield [RunInfo.from_proto(r) for r in resp.runs]
            token = resp.next_page_token
            if not token:
                return

    async def cancel(self, run_id: str) -> RunInfo:
        request = learner_pb2.CancelRunRequest(run_id=run_id)
        return RunInfo.from_proto(await self._call(self.stub.CancelRun, request))

    async def watch(
        self, run_id: str, from_start: bool = True, timeout: float = WATCH_TIMEOUT_S
    ) -> AsyncIterator[RunEvent]:
        request = learner_pb2.WatchRunRequest(run_id=run_id, from_start=from_start)
        try:
            async for event in self.stub.WatchRun(request, timeout=timeout):
                yield _event(event)
        except grpc.RpcError as err:
            raise _translate(err, self.address) from None

    async def wait(self, run_id: str, timeout: float = 3600.0, poll_s: float = 1.0) -> RunInfo:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            run = await self.get(run_id)
            if run.done:
                return run
            if loop.time() > deadline:
                raise TimeoutError(f"run {run_id} still {run.state} after {timeout:.0f}s")
            await asyncio.sleep(poll_s)


def _event(event: learner_pb2.RunEvent) -> RunEvent:
    metrics = json.loads(event.metrics_json) if event.metrics_json else None
    return RunEvent(metrics=metrics, run=RunInfo.from_proto(event.run))
