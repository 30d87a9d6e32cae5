"""`marl episode SPEC.yaml --problem N [--checkpoint DIR]`: one episode on a running cluster.

For looking at what a workflow actually does with a model before (or after)
training it: the spec's workflow, routing, sampling and caps, one problem of its
data, and the adapters of a checkpoint (`--checkpoint`: a `checkpoints/step_N`
directory or a run directory, whose `latest` is used) or, without one, adapters
equal to the base model (LoRA B = 0, the learner's version 0). The adapters are
pushed to every inference replica under a fresh name, the episode runs on a
workflow worker (`Workflow.RunEpisode`, the same code path training uses), the
transcript is printed, and the adapters are unloaded again.

The cluster is the one `marl up --dir DIR` wrote `DIR/endpoints.json` for.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from marl.problem import Problem
from marl.rollout import AdapterRef, Rollout, Task
from marl.spec.run import RunSpec, SpecError

RPC_TIMEOUT_S = 60.0
EPISODE_TIMEOUT_S = 1800.0


@dataclass
class Adapter:
    """One policy's LoRA as it travels to inference."""

    state: dict[str, Any]
    rank: int
    alpha: float
    target_modules: list[str]


def checkpoint_dir(path: str) -> Path:
    """A `step_N` checkpoint directory from itself, a run directory or its `checkpoints/`."""
    p = Path(path)
    for candidate in (p, p / "checkpoints"):
        latest = candidate / "latest"
        if latest.is_file():
            return candidate / latest.read_text().strip()
    if (p / "adapters").is_dir():
        return p
    raise SpecError(
        f"--checkpoint {path!r}: not a checkpoint (no adapters/) nor a run directory with "
        "checkpoints/latest"
    )


def load_checkpoint(path: str, policies: list[str]) -> dict[str, Adapter]:
    from safetensors.torch import load_file

    ckpt = checkpoint_dir(path)
    out = {}
    for policy in policies:
        folder = ckpt / "adapters" / policy
        if not (folder / "adapter_model.safetensors").is_file():
            have = sorted(d.name for d in (ckpt / "adapters").iterdir() if d.is_dir())
            raise SpecError(
                f"--checkpoint {str(ckpt)!r} has no adapter for policy {policy!r} (it has "
                f"{', '.join(have) or 'none'}); the spec's `policy`/`policy_groups` must match "
                "the run that wrote it"
            )
        config = json.loads((folder / "adapter_config.json").read_text())
        modules = config["target_modules"]
        out[policy] = Adapter(
            load_file(str(folder / "adapter_model.safetensors")),
            int(config["r"]),
            float(config["lora_alpha"]),
            sorted(modules) if isinstance(modules, list) else [modules],
        )
    return out


def base_adapters(spec: RunSpec, policies: list[str]) -> dict[str, Adapter]:
    """Adapters equal to the base model: PEFT's initialisation (B = 0), as at step 0."""
    import torch
    from peft import get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from marl.models.lora import with_lora

    torch.manual_seed(spec.seed)
    model = with_lora(AutoModelForCausalLM.from_pretrained(spec.model.path), spec.lora)
    state = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    peft_config: Any = model.peft_config["default"]
    modules = sorted(peft_config.target_modules)
    return {p: Adapter(state, spec.lora.rank, spec.lora.alpha, modules) for p in policies}


def pick_problem(spec: RunSpec, index: int, split: str) -> Problem:
    from marl.data import load_problems

    problems = load_problems(spec.data, split, spec.seed)  # type: ignore[arg-type]
    if not 0 <= index < len(problems):
        raise SpecError(
            f"--problem {index}: the {split} split of {spec.data.train if split == 'train' else spec.data.val} "
            f"has problems 0..{len(problems) - 1}"
        )
    return problems[index]


def make_task(spec: RunSpec, run_id: str, problem: Problem, adapters: dict[str, AdapterRef],
              kind: str, sample: int) -> Task:
    """The task the learner would enqueue for this problem (step 0)."""
    return Task.for_spec(spec, run_id, problem, 0, kind, sample, adapters)  # type: ignore[arg-type]


def render(rollout: Rollout, problem: Problem) -> str:
    """The transcript, one block per turn, as a person reads it."""
    lines = [f"problem {problem.id} ({problem.task})", indent(problem.prompt), ""]
    for i, t in enumerate(rollout.turns):
        lines.append(
            f"[{i}] {t.role}[{t.slot}]  {t.adapter.name}@{t.adapter.version}  "
            f"prompt {len(t.prompt_ids)} tok, completion {len(t.completion_ids)} tok, "
            f"finish {t.finish_reason}"
        )
        lines += [indent(t.text), ""]
    if rollout.error is not None:
        lines.append(f"episode FAILED (left out of training): {rollout.error}")
    else:
        lines += ["final answer:", indent(rollout.final_text), f"reward: {rollout.reward:g}"]
    for name, value in sorted(rollout.facts.items()):
        lines.append(f"fact {name}: {value:g}")
    lines.append(f"seconds: {rollout.seconds:.2f}")
    return "\n".join(lines)


def indent(text: str) -> str:
    return "\n".join("    " + line for line in (text or "(empty)").splitlines() or [""])


def endpoints_of(path: str) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        p = p / "endpoints.json"
    if not p.is_file():
        raise SpecError(
            f"--endpoints {path!r}: no endpoints.json there; start a cluster with "
            "`marl up --dir DIR` and pass DIR"
        )
    data: dict[str, Any] = json.loads(p.read_text())
    if not data.get("inference") or not data.get("workflow"):
        raise SpecError(f"--endpoints {str(p)!r}: lists no inference or no workflow server")
    return data


def run_episode(spec: RunSpec, problem: Problem, endpoints: dict[str, Any],
                adapters: dict[str, Adapter], role_policy: dict[str, str], kind: str,
                sample: int) -> Rollout:
    """Push the adapters, run one episode on the first workflow server, unload them."""
    import grpc

    from marl.models.identity import base_model_id
    from marl.protocol import adapter_io
    from marl.protocol.v1 import (
        common_pb2,
        inference_pb2,
        inference_pb2_grpc,
        workflow_pb2,
        workflow_pb2_grpc,
    )
    from marl.runtime import auth

    run_id = f"episode-{uuid.uuid4().hex[:8]}"
    base_model = base_model_id(spec.model.path)
    refs = {p: AdapterRef(f"{run_id}/{p}", 0) for p in adapters}
    channels = [auth.channel(a) for a in endpoints["inference"]]
    stubs = [inference_pb2_grpc.InferenceStub(ch) for ch in channels]
    try:
        for policy, adapter in adapters.items():
            payload = adapter_io.serialize(adapter.state)
            manifest = adapter_io.make_manifest(refs[policy].name, 0, base_model, adapter.rank,
                                                adapter.alpha, adapter.target_modules, payload)
            for stub in stubs:
                try:
                    stub.PushAdapter(adapter_io.chunks(manifest, payload), timeout=RPC_TIMEOUT_S)
                except grpc.RpcError as err:
                    if err.code() in (grpc.StatusCode.FAILED_PRECONDITION,
                                      grpc.StatusCode.INVALID_ARGUMENT):
                        raise SpecError(f"inference refused the adapter: {err.details()}") from None
                    raise
        task = make_task(spec, run_id, problem,
                         {role: refs[p] for role, p in role_policy.items()}, kind, sample)
        with auth.channel(endpoints["workflow"][0]) as ch:
            resp = workflow_pb2_grpc.WorkflowStub(ch).RunEpisode(
                workflow_pb2.RunEpisodeRequest(task_json=json.dumps(task.to_dict())),
                timeout=EPISODE_TIMEOUT_S,
            )
        return Rollout.from_dict(json.loads(resp.rollout_json))
    finally:
        for stub in stubs:
            for ref in refs.values():
                try:
                    stub.UnloadAdapter(inference_pb2.UnloadAdapterRequest(
                        ref=common_pb2.AdapterRef(name=ref.name, version=ref.version)),
                        timeout=RPC_TIMEOUT_S)
                except grpc.RpcError:  # a replica that never got it, or has gone: nothing to free
                    pass
        for ch in channels:
            ch.close()


def main(spec: RunSpec, problem_index: int, checkpoint: str | None, endpoints_path: str,
         split: str, sample: int, as_json: bool) -> int:
    from marl.workflows import policy_of_role

    role_policy = policy_of_role(spec)
    problem = pick_problem(spec, problem_index, split)
    endpoints = endpoints_of(endpoints_path)
    policies = sorted(set(role_policy.values()))
    adapters = (load_checkpoint(checkpoint, policies) if checkpoint
                else base_adapters(spec, policies))
    kind = "train" if split == "train" else "val"
    rollout = run_episode(spec, problem, endpoints, adapters, role_policy, kind, sample)
    print(json.dumps(rollout.to_dict()) if as_json else render(rollout, problem))
    return 0 if rollout.error is None else 1
