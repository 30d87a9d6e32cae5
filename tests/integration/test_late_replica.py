"""An inference replica that starts mid-run reports SERVING only once it holds the run's
current adapter versions, and from then on gets every new version like the others.

Every service is a real process. The run is long enough to still be training when the
late replica is up; the test cancels it once it has seen what it needs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from marl.local.launcher import Cluster
from marl.protocol.v1 import inference_pb2, inference_pb2_grpc, learner_pb2
from marl.runtime import replicas, streams
from marl.spec.services import LearnerConfig
from services.learner.adapter_sync import ACKS_KEPT_S
from services.learner.runs import acks_key, run_key
from tests.support import runs
from tests.support.runs import submit, wait_for
from tests.support.specs import small_spec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # the session's tiny model may be built first

POLICIES = ("generator", "aggregator")


def current_versions(r: redis.Redis, run_id: str) -> dict[str, int]:
    """Policy -> version the learner currently publishes for `run_id`."""
    out = {}
    entries: Any = r.hgetall(replicas.CURRENT_ADAPTERS)
    for name, raw in entries.items():
        if json.loads(raw)["run_id"] == run_id:
            out[name.split("/", 1)[1]] = int(json.loads(raw)["version"])
    return out


def health_status(stub: health_pb2_grpc.HealthStub) -> int | None:
    try:
        return int(stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status)
    except grpc.RpcError:
        return None  # not listening yet


def test_late_replica_serves_only_with_current_adapters(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cluster = Cluster(
        tmp_path / "cluster",
        str(tiny_model_dir),
        sandbox_replicas=0,
    )
    cluster.start()
    try:
        assert cluster.redis_url is not None
        r = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
        # two adapters (isolated), both to be synced; cancelled long before step 200
        spec = small_spec(
            "it-late", tmp_path / "run", tiny_model_dir, policy="isolated", steps=200, group=2,
            rollouts_logged=0, step_timeout_s=120, temperature=2.0, max_tokens=4,
            caps={"voting_candidates": 1},
        )
        run_id = submit(cluster, spec)
        learner = runs.stub(cluster)

        # the late replica misses at least the initial push and the first step's
        missed = wait_for(
            lambda: (v := current_versions(r, run_id)) and min(v.values()) >= 1 and v,
            180,
            "version 1 to be published",
        )
        assert sorted(missed) == sorted(POLICIES)
        late = cluster.add_inference_replica(wait=False)

        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(late.address))
        saw_not_serving = False
        deadline = time.monotonic() + 180
        while (status := health_status(health)) != health_pb2.HealthCheckResponse.SERVING:
            saw_not_serving |= status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert late.proc.poll() is None, late.log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the late replica never reported SERVING"
            time.sleep(0.02)
        stub = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(late.address))
        listed = stub.ListAdapters(inference_pb2.ListAdaptersRequest(), timeout=10).adapters
        assert saw_not_serving  # it was up, but held back until it had the adapters

        held: dict[str, list[int]] = {}
        for a in listed:
            run, policy = a.ref.name.split("/", 1)
            assert run == run_id
            held.setdefault(policy, []).append(a.ref.version)
        # versions published before the replica started (monotonic: it cannot hold older)
        for policy, version in missed.items():
            assert held.get(policy) and max(held[policy]) >= version, (held, missed)

        # from then on every new version reaches it too, each acknowledgement recorded
        replica_id = stub.GetInfo(inference_pb2.GetInfoRequest(), timeout=10).replica_id
        joined = {p: max(v) for p, v in held.items()}

        def acked() -> dict[str, list[int]]:
            acks: Any = r.hgetall(acks_key(run_id))
            return {
                p: sorted(int(k.split("@")[1]) for k in acks if k.startswith(f"{replica_id}/{p}@"))
                for p in POLICIES
            }

        pushed = wait_for(
            lambda: (a := acked()) and all(a[p] and a[p][-1] >= joined[p] + 2 for p in a) and a,
            180,
            "two more steps pushed to the late replica",
        )
        for policy in POLICIES:
            assert pushed[policy][0] >= missed[policy]  # nothing older was sent
            assert pushed[policy] == list(range(pushed[policy][0], pushed[policy][-1] + 1))

        # the run's requirement is withdrawn when it ends: new replicas need nothing from it
        learner.CancelRun(learner_pb2.CancelRunRequest(run_id=run_id), timeout=10)
        wait_for(
            lambda: (
                learner.GetRun(learner_pb2.GetRunRequest(run_id=run_id), timeout=10).state
                == "CANCELLED"
            ),
            120,
            "the run to be cancelled",
        )
        assert current_versions(r, run_id) == {}
        # what outlives the run: its history (the record GetRun reads, the metrics WatchRun
        # replays) and, for a day, its acks; its rollouts stream is deleted
        # (the learner releases the run's lease just after the run turns CANCELLED)
        kept = sorted([run_key(run_id), streams.metrics_stream(run_id), acks_key(run_id)])
        wait_for(lambda: sorted(r.scan_iter(f"*{run_id}*")) == kept, 30, "the run's lease to go")
        assert 0 < r.ttl(acks_key(run_id)) <= ACKS_KEPT_S
        # the record and the metrics live for the learner's retention (a week by default)
        week = LearnerConfig().retention_s
        for key in (run_key(run_id), streams.metrics_stream(run_id)):
            assert week - 600 < r.ttl(key) <= week
    finally:
        cluster.stop()
