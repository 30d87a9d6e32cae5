"""A learner that stalls past its lease (SIGSTOP: a GC pause, a frozen VM) while another
learner takes its run over stops the run when it wakes, before its next push or
checkpoint, and the new holder's fencing token refuses what the stale one would write.

Two real learner processes take runs from one queue (`learner.replicas` 2), with a real
inference replica, a workflow worker and Redis.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import grpc
import pytest

from marl.local.launcher import Process
from marl.protocol import adapter_io
from marl.protocol.v1 import inference_pb2, inference_pb2_grpc
from services.learner.runs import LEASE_S
from tests.support.cluster import ClusterFactory
from tests.support.runs import rows, submit, wait_end
from tests.support.specs import small_spec

pytestmark = [pytest.mark.slow, pytest.mark.resume, pytest.mark.timeout(900)]

STEPS = 10


def wait_for(what: str, check: object, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def loaded_versions(inference: Process, run_id: str) -> list[int]:
    """The versions of the run's adapters the replica loaded, in the order it loaded them."""
    pattern = re.compile(rf"loaded {re.escape(run_id)}/\w+@(\d+) ")
    return [int(m.group(1)) for m in pattern.finditer(inference.log_path.read_text())]


def test_a_learner_whose_lease_is_taken_stops_and_its_writes_are_refused(
    tmp_path: Path, clusters: ClusterFactory
) -> None:
    c = clusters(sandbox_replicas=0, learner_replicas=2, max_concurrent_runs=1)
    out = tmp_path / "fenced"
    spec = small_spec("fenced", out, steps=STEPS, group=4, problems=2, policy="shared")
    spec["train"]["checkpoint_interval"] = 1
    run_id = submit(c, spec)
    learners = [p for p in c.processes if p.kind == "learner"]
    (inference,) = [p for p in c.processes if p.kind == "inference"]
    wait_for("step 2 was never logged", lambda: len(rows(out)) >= 3)

    def trains(p: Process) -> bool:
        return f"training run {run_id}" in p.log_path.read_text()

    (stale,) = [p for p in learners if trains(p)]
    (holder,) = [p for p in learners if p is not stale]
    os.killpg(stale.proc.pid, signal.SIGSTOP)
    try:
        stopped_at = len(rows(out))
        assert stopped_at <= STEPS, "the run ended before its learner was stopped"
        wait_for("the other learner never took the run over", lambda: trains(holder),
                 timeout_s=LEASE_S * 10)
        fence_file = out / "checkpoints" / "fence"
        wait_for("the new holder never wrote its token beside the checkpoints",
                 lambda: fence_file.exists() and fence_file.read_text() == "2")
        wait_for("the new holder never pushed",
                 lambda: max(loaded_versions(inference, run_id)) > STEPS)
    finally:
        os.killpg(stale.proc.pid, signal.SIGCONT)
    wait_for("the stale learner never stopped the run",
             lambda: f"stopped run {run_id}" in stale.log_path.read_text(), timeout_s=120)
    run = wait_end(c, run_id)
    assert run.state == "SUCCEEDED", run.error
    assert run.step == STEPS

    # nothing the stale learner (versions 0..STEPS) pushed loaded after the holder's
    versions = loaded_versions(inference, run_id)
    first_new = next(i for i, v in enumerate(versions) if v > STEPS)
    assert all(v > STEPS for v in versions[first_new:]), versions
    # the stale learner's, before the holder's first: within its own versions (a holder
    # that is quick may push before the test sees its token, so this reads the order)
    assert max(versions[:first_new], default=0) <= STEPS, versions
    # every checkpoint from the takeover on is the holder's, `latest` among them
    checkpoints = out / "checkpoints"
    latest = checkpoints / (checkpoints / "latest").read_text()
    assert json.loads((latest / "state.json").read_text())["fence"] == 2
    # each step logged once, in order: the stale learner wrote no record after waking
    assert [r["step"] for r in rows(out)] == list(range(STEPS + 1))
    stale_log = stale.log_path.read_text()
    assert f"run {run_id} ended" not in stale_log  # it recorded no end of its own

    # the holder's token refuses the stale one's push, as the replica saw it
    stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(inference.address))
    base = stub.GetInfo(inference_pb2.GetInfoRequest(), timeout=10).base_model
    payload = (latest / "adapters" / "shared" / "adapter_model.safetensors").read_bytes()
    manifest = adapter_io.make_manifest(f"{run_id}/shared", 10_000, base, 4, 8.0,
                                        ["q_proj"], payload, run_id=run_id, fence=1)
    with pytest.raises(grpc.RpcError) as err:
        stub.PushAdapter(adapter_io.chunks(manifest, payload), timeout=60)
    assert err.value.code() == grpc.StatusCode.ABORTED
    assert "fencing token 1 is stale" in (err.value.details() or "")

