"""Validation samples where slots run in parallel, on the same draws at every checkpoint.

One real `marl serve inference` process (transformers engine, the shipped demo model)
and one real workflow worker, asked through `Workflow.RunEpisode` for validation
episodes of Voting and Orch-Workers as the learner makes them (`Task.for_spec`). One
adapter is pushed as two versions with the same weights, the checkpoints of steps 10
and 20 of a run whose adapter did not change: every turn's text must be the same at
both, while the parallel slots (three generators, three workers) write different texts,
which greedy decoding (`sampling.val_temperature: 0`) does not.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch

from marl.data import load_problems
from marl.local.launcher import Cluster
from marl.models.demo import demo_model_dir
from marl.protocol import adapter_io
from marl.protocol.v1 import inference_pb2, inference_pb2_grpc, workflow_pb2, workflow_pb2_grpc
from marl.rollout import AdapterRef, Task
from marl.spec.run import parse_spec

pytestmark = pytest.mark.timeout(900)

TARGETS = ["q_proj", "v_proj"]
RANK = 4
ADAPTER = "val-seeds/shared"
PROBLEMS = 6
PARALLEL = {"voting": "generator", "orch_workers": "worker"}


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[workflow_pb2_grpc.WorkflowStub]:
    """A workflow worker whose one inference replica holds ADAPTER at versions 10 and 20,
    the same weights twice."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model_dir = demo_model_dir()
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                          LoraConfig(r=RANK, lora_alpha=8, target_modules=TARGETS))
    gen = torch.Generator().manual_seed(0)
    state = {k: 0.02 * torch.randn(v.shape, generator=gen)
             for k, v in get_peft_model_state_dict(peft).items()}
    cluster = Cluster(tmp_path_factory.mktemp("val-seeds"), str(model_dir), sandbox_replicas=0,
                      learner=False, max_lora_rank=RANK)
    endpoints = cluster.start()
    try:
        (address,) = endpoints["inference"]
        inference = inference_pb2_grpc.InferenceStub(grpc.insecure_channel(address))
        base = inference.GetInfo(inference_pb2.GetInfoRequest(), timeout=30).base_model
        payload = adapter_io.serialize(state)
        for version in (10, 20):
            manifest = adapter_io.make_manifest(ADAPTER, version, base, RANK, 8.0, TARGETS,
                                                payload)
            assert inference.PushAdapter(adapter_io.chunks(manifest, payload), timeout=60).loaded
        (workflow_address,) = endpoints["workflow"]
        yield workflow_pb2_grpc.WorkflowStub(grpc.insecure_channel(workflow_address))
    finally:
        cluster.stop()


def validation(stub: workflow_pb2_grpc.WorkflowStub, workflow: str, step: int,
               **sampling: Any) -> list[dict[str, Any]]:
    """The rollouts of one validation at `step` (adapter version `step`), one per problem."""
    spec = parse_spec({
        "workflow": workflow, "policy": "shared", "model": {"path": str(demo_model_dir())},
        "sampling": {"temperature": 1.0, "max_tokens": 8, **sampling},
        "data": {"train": "arithmetic", "val": "arithmetic"},
    })
    rollouts = []
    for problem in load_problems(spec.data, "val", spec.seed)[:PROBLEMS]:
        adapters = {role: AdapterRef(ADAPTER, step) for role in ("generator", "aggregator",
                                                                 "orchestrator", "worker",
                                                                 "synthesizer")}
        task = Task.for_spec(spec, "val-seeds", problem, step, "val", 0, adapters)
        reply = stub.RunEpisode(workflow_pb2.RunEpisodeRequest(
            task_json=json.dumps(task.to_dict())), timeout=300)
        rollout = json.loads(reply.rollout_json)
        assert rollout["error"] is None, rollout["error"]
        rollouts.append(rollout)
    return rollouts


def texts(rollout: dict[str, Any]) -> dict[tuple[str, int], str]:
    return {(t["role"], t["slot"]): t["text"] for t in rollout["turns"]}


def slot_texts(rollout: dict[str, Any], role: str) -> list[str]:
    return [t["text"] for t in rollout["turns"] if t["role"] == role]


@pytest.mark.parametrize("workflow", ["voting", "orch_workers"])
def test_parallel_slots_differ_and_every_checkpoint_draws_the_same(
    worker: workflow_pb2_grpc.WorkflowStub, workflow: str
) -> None:
    ten, twenty = validation(worker, workflow, 10), validation(worker, workflow, 20)
    assert [texts(r) for r in ten] == [texts(r) for r in twenty]
    assert {t["adapter"]["version"] for r in twenty for t in r["turns"]} == {20}
    role = PARALLEL[workflow]
    slots = [slot_texts(r, role) for r in ten]
    assert all(len(s) == 3 for s in slots)
    assert any(len(set(s)) > 1 for s in slots), slots  # the slots draw apart
    greedy = [slot_texts(r, role) for r in validation(worker, workflow, 10, val_temperature=0)]
    assert all(len(set(s)) == 1 for s in greedy), greedy  # one prompt, one greedy text
