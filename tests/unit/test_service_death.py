"""`marl demo` / `marl up` name a service that died (which one, how, its log), and the CLI
takes key=value overrides wherever they stand."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from marl.cli.main import build_parser, main
from marl.local.demo import _Watchdog, _WatchedStub
from marl.local.launcher import Cluster, Process


def spawn(kind: str, code: str, tmp: Path) -> Process:
    proc = subprocess.Popen([sys.executable, "-c", code])
    return Process(kind, "127.0.0.1:1", proc, tmp / f"{kind}-0.log")


def test_exit_description_names_service_signal_and_log(tmp_path: Path) -> None:
    learner = spawn("learner", "import time; time.sleep(60)", tmp_path)
    workflow = spawn("workflow", "raise SystemExit(3)", tmp_path)
    assert learner.exit_description() is None
    learner.proc.send_signal(signal.SIGKILL)
    learner.proc.wait()
    workflow.proc.wait()
    text = learner.exit_description()
    assert text is not None
    assert "learner service" in text and "SIGKILL" in text and "OOM" in text
    assert str(tmp_path / "learner-0.log") in text
    assert f"pid {learner.proc.pid}" in text
    assert "workflow service" in str(workflow.exit_description())
    assert "exited with code 3" in str(workflow.exit_description())


class FakeCall:
    """Stands in for the WatchRun stream: records the watchdog's cancel."""

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FakeStub:
    def WatchRun(self, request: object) -> FakeCall:  # noqa: N802
        return FakeCall()


def test_watchdog_cancels_the_watch_when_a_service_dies(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, "unused")
    alive = spawn("inference", "import time; time.sleep(60)", tmp_path)
    doomed = spawn("workflow", "import time; time.sleep(60)", tmp_path)
    cluster.processes = [alive, doomed]
    watched = _WatchedStub(FakeStub())
    call = watched.WatchRun(None)
    dog = _Watchdog(cluster, watched)
    dog.start()
    try:
        time.sleep(0.7)
        assert not call.cancelled and not dog.died
        doomed.proc.send_signal(signal.SIGTERM)
        dog.join(5)
        assert call.cancelled
        assert len(dog.died) == 1 and "workflow service" in dog.died[0]
        assert "SIGTERM" in dog.died[0]
    finally:
        for p in (alive, doomed):
            p.proc.kill()
            p.proc.wait()


def test_overrides_after_an_option_are_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def fake_demo(
        out: str | None, steps: int | None, overrides: list[str], trace: bool = False
    ) -> int:
        seen.update(steps=steps, overrides=overrides)
        return 0

    monkeypatch.setattr("marl.local.demo.run_demo", fake_demo)
    assert main(["demo", "model.path=M", "--steps", "2", "lora.rank=8", "grpo.group_size=4"]) == 0
    assert seen == {"steps": 2, "overrides": ["model.path=M", "lora.rank=8", "grpo.group_size=4"]}
    with pytest.raises(SystemExit):
        main(["demo", "--steps", "2", "--bogus"])
    assert build_parser().parse_known_args(["demo", "a=1", "--steps", "2", "b=2"])[1] == ["b=2"]



def test_a_grpc_error_from_a_dying_service_is_one_line_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import grpc

    class Removed(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.UNKNOWN

        def details(self) -> str:
            return "Stream removed"

    def dying(
        out: str | None, steps: int | None, overrides: list[str], trace: bool = False
    ) -> int:
        raise Removed()

    monkeypatch.setattr("marl.local.demo.run_demo", dying)
    assert main(["demo"]) == 1
    err = capsys.readouterr().err
    assert "UNKNOWN: Stream removed" in err and "Traceback" not in err


def test_dump_stacks_writes_threads_and_tasks_to_the_service_log(tmp_path: Path) -> None:
    """What a hung run's services were waiting on: every thread (SIGUSR1, written from C)
    and every asyncio task (SIGUSR2), in each service's own log."""
    cluster = Cluster(tmp_path, "unused")
    sandbox = cluster.add("sandbox", [], wait=False)
    try:
        deadline = time.monotonic() + 60
        while "\nlistening on" not in _read(sandbox.log_path) and time.monotonic() < deadline:
            time.sleep(0.2)
        cluster.dump_stacks()
        while "asyncio tasks" not in _read(sandbox.log_path) and time.monotonic() < deadline:
            time.sleep(0.2)
        text = _read(sandbox.log_path)
        assert "hread 0x" in text and "in run_forever" in text
        assert "asyncio tasks" in text and "services/reward_sandbox/server.py" in text
        assert sandbox.proc.poll() is None
    finally:
        cluster.stop()


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def test_a_child_started_by_die_with_parent_dies_with_it() -> None:
    """The launcher's children (services, Redis) get SIGTERM when it is SIGKILLed; started
    without a preexec_fn (see `die_with_parent`)."""
    code = (
        "import subprocess, time\n"
        "from marl.runtime.processes import die_with_parent\n"
        "child = subprocess.Popen(die_with_parent(['sleep', '60']))\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    deadline = time.monotonic() + 10
    while "sleep" not in Path(f"/proc/{child}/cmdline").read_text():  # exec'd
        assert time.monotonic() < deadline
        time.sleep(0.05)
    parent.kill()
    parent.wait()
    while Path(f"/proc/{child}").exists() and _state(child) != "Z":
        assert time.monotonic() < deadline, "the child outlived its parent"
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"
