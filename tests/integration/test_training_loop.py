"""The whole loop with every service a real process and a real Redis: 2 training steps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import redis
import yaml
from safetensors.torch import load_file

from marl.local.launcher import Cluster
from marl.protocol import adapter_io
from marl.protocol.v1 import (
    common_pb2,
    inference_pb2,
    inference_pb2_grpc,
    learner_pb2,
    learner_pb2_grpc,
)
from marl.runtime import streams

pytestmark = [pytest.mark.timeout(600), pytest.mark.cluster(model_fixture="tiny_model_dir", sandbox_replicas=0)]


def small_spec(model_dir: Path, out_dir: Path, policy: str) -> dict:
    return {
        "name": f"it-{policy}",
        "workflow": "voting",
        "policy": policy,
        "out_dir": str(out_dir),
        "model": {"path": str(model_dir)},
        "lora": {"rank": 4, "alpha": 8},
        "optim": {"lr": 1e-2, "warmup_steps": 0},
        "grpo": {"group_size": 4},
        "train": {
            "steps": 2,
            "problems_per_step": 4,
            "val_interval": 2,
            "val_problems": 8,
            "checkpoint_interval": 1,
            "step_timeout_s": 120,
        },
        "sampling": {"temperature": 2.0, "max_tokens": 6},  # diverse samples: rewards vary
        "data": {"train": "arithmetic", "val": "arithmetic"},
    }


def run_to_end(cluster: Cluster, spec: dict) -> learner_pb2.Run:
    stub = learner_pb2_grpc.LearnerStub(grpc.insecure_channel(cluster.endpoints()["learner"]))
    run_id = stub.SubmitRun(
        learner_pb2.SubmitRunRequest(spec_yaml=yaml.safe_dump(spec)), timeout=60
    ).run_id
    for _ in stub.WatchRun(
        learner_pb2.WatchRunRequest(run_id=run_id, from_start=True), timeout=500
    ):
        pass
    return stub.GetRun(learner_pb2.GetRunRequest(run_id=run_id), timeout=10)


@pytest.mark.parametrize("policy", ["shared", "isolated"])
def test_two_steps_end_to_end(
    cluster: Cluster, tiny_model_dir: Path, tmp_path: Path, policy: str
) -> None:
    out = tmp_path / "run"
    run = run_to_end(cluster, small_spec(tiny_model_dir, out, policy))
    assert run.state == "SUCCEEDED", run.error
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "val/accuracy" in rows[0] and "val/accuracy" in rows[-1]
    assert rows[1]["train/episode_errors"] == 0
    roles = ("generator", "aggregator")
    for role in roles:
        assert f"role/{role}/response_len_mean" in rows[1]
    policies = ["shared"] if policy == "shared" else list(roles)
    for p in policies:
        assert rows[1][f"policy/{p}/grad_norm"] > 0
        # inference sampled with the very version the learner trained: the engines agree
        for row in rows[1:]:
            assert row[f"policy/{p}/logprob_gap"] < 1e-3, row[f"policy/{p}/logprob_gap"]
    assert not [a for r in rows for a in r.get("alarms", []) if "sampler_mismatch" in str(a)]

    # every turn names the adapter version that served it: version t at step t
    for step in (1, 2):
        for line in (out / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines():
            rollout = json.loads(line)
            assert len(rollout["turns"]) == 4  # 3 generators + aggregator
            for turn in rollout["turns"]:
                expected_policy = "shared" if policy == "shared" else turn["role"]
                assert turn["adapter"] == {
                    "name": f"{run.run_id}/{expected_policy}",
                    "version": step - 1,
                }

    # a finished run's adapters are unloaded from the replicas (its checkpoints keep them)
    inference = inference_pb2_grpc.InferenceStub(
        grpc.insecure_channel(cluster.endpoints()["inference"][0])
    )
    listed = inference.ListAdapters(inference_pb2.ListAdaptersRequest(), timeout=10).adapters
    assert not [a.ref.name for a in listed if a.ref.name.startswith(f"{run.run_id}/")]
    # and its rollouts stream is gone from Redis; its record and metrics stay
    r = redis.Redis.from_url(cluster.redis_url)
    assert not r.exists(streams.rollouts_stream(run.run_id))
    assert r.exists(streams.metrics_stream(run.run_id))

    # the learner trained something: step-1 adapters are not the zero-B version 0
    for p in policies:
        weights = load_file(
            str(out / "checkpoints" / "step_000001" / "adapters" / p / "adapter_model.safetensors")
        )
        b = [v for k, v in weights.items() if "lora_B" in k]
        assert b and any(float(t.abs().max()) > 0 for t in b)


def _push(
    stub: inference_pb2_grpc.InferenceStub,
    name: str,
    version: int,
    state: dict,
    base_model: str,
    target_modules: list[str],
) -> None:
    payload = adapter_io.serialize(state)
    manifest = adapter_io.make_manifest(name, version, base_model, 4, 8.0, target_modules, payload)
    stub.PushAdapter(adapter_io.chunks(manifest, payload), timeout=60)


def test_served_adapter_after_step_one_differs_from_version_zero(
    cluster: Cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    run = run_to_end(cluster, small_spec(tiny_model_dir, out, "shared"))
    assert run.state == "SUCCEEDED", run.error
    # the first step whose groups carried a signal (a step where every group's rewards
    # were equal leaves the adapter at version 0 — GRPO's advantage is zero there)
    checkpoints = [
        load_file(
            str(
                out / "checkpoints" / f"step_{step:06d}" / "adapters" / "shared"
                / "adapter_model.safetensors"
            )
        )
        for step in (1, 2)
    ]
    trained = [
        w for w in checkpoints
        if any(float(v.abs().max()) > 0 for k, v in w.items() if "lora_B" in k)
    ]
    assert trained, "no step changed the adapter"
    step1 = trained[0]
    zero = {k: (v if "lora_A" in k else v * 0) for k, v in step1.items()}
    channel = grpc.insecure_channel(cluster.endpoints()["inference"][0])
    stub = inference_pb2_grpc.InferenceStub(channel)
    info = stub.GetInfo(inference_pb2.GetInfoRequest(), timeout=10)
    modules = sorted({k.split(".")[-3] for k in step1})
    _push(stub, "probe/p", 0, zero, info.base_model, modules)
    _push(stub, "probe/p", 1, step1, info.base_model, modules)
    prompt = list(range(6, 20))

    def generate(version: int) -> inference_pb2.GenerateResponse:
        return stub.Generate(
            inference_pb2.GenerateRequest(
                prompt_token_ids=prompt,
                adapter=common_pb2.AdapterRef(name="probe/p", version=version),
                sampling=inference_pb2.SamplingParams(max_tokens=4, temperature=0.0),
            ),
            timeout=60,
        )

    v0, v1 = generate(0), generate(1)
    assert (v0.served_by.name, v0.served_by.version) == ("probe/p", 0)
    assert (v1.served_by.name, v1.served_by.version) == ("probe/p", 1)
    assert list(v0.logprobs) != pytest.approx(list(v1.logprobs), abs=1e-6)
    # a version that was never pushed is refused, not served by the base model
    with pytest.raises(grpc.RpcError) as err:
        generate(7)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_submit_rejects_bad_spec_with_field_named(
    cluster: Cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    learner = cluster.endpoints()["learner"]
    stub = learner_pb2_grpc.LearnerStub(grpc.insecure_channel(learner))
    for spec, field in [
        ({"grpo": {"group_size": 0}}, "grpo.group_size"),
        ({"optim": {"learning_rate": 1}}, "optim.learning_rate"),
    ]:
        with pytest.raises(grpc.RpcError) as err:
            stub.SubmitRun(learner_pb2.SubmitRunRequest(spec_yaml=yaml.safe_dump(spec)), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in err.value.details()

        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump(spec))
        proc = subprocess.run(
            [sys.executable, "-m", "marl.cli", "submit", str(path), "--learner", learner],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2
        assert field in proc.stderr
        assert "Traceback" not in proc.stderr


def test_two_learner_ranks_train_as_one(
    cluster: Cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """learner.world_size 2 (FSDP2 over gloo) in a real run: the same rollouts (same seed)
    train to the same losses and step-1 adapters as one learner process."""
    runs = {}
    for world_size in (1, 2):
        spec = small_spec(tiny_model_dir, tmp_path / f"ws{world_size}", "isolated")
        spec["name"] = f"it-ws{world_size}"
        spec["learner"] = {"world_size": world_size}
        run = run_to_end(cluster, spec)
        assert run.state == "SUCCEEDED", run.error
        runs[world_size] = [
            json.loads(line)
            for line in (tmp_path / f"ws{world_size}" / "metrics.jsonl").read_text().splitlines()
        ]
    one, two = runs[1], runs[2]
    assert [r["step"] for r in two] == [0, 1, 2]
    for key in ("policy/generator/loss", "policy/aggregator/loss", "role/generator/entropy"):
        assert two[1][key] == pytest.approx(one[1][key], rel=1e-4, abs=1e-6), key
    for p in ("generator", "aggregator"):
        path = Path("checkpoints/step_000001/adapters") / p / "adapter_model.safetensors"
        a, b = load_file(str(tmp_path / "ws1" / path)), load_file(str(tmp_path / "ws2" / path))
        for k in a:
            assert float((a[k] - b[k]).abs().max()) < 1e-5, k
