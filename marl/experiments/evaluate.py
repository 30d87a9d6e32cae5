"""`marl eval` and `marl attribute`: validate a workflow with each role served by a chosen
saved adapter or by the base model.

The evaluation runs exactly like the learner's validation (`services/learner/validator.py`):
the same validation problems, the same tasks on the workers' stream, the same metrics. Only
the routing differs: each distinct adapter is pushed to every serving inference replica under
a fresh name (`eval-<id>/<label>`) and unloaded afterwards. The base model is served as a
LoRA adapter whose weights are all zero, which adds exactly nothing to the base model's
output: the same thing a run serves at step 0 (PEFT starts `lora_B` at zero).

Routing syntax (`--adapters`): `role=RUN_DIR@CHECKPOINT[:POLICY]` or `role=base`, comma
separated; `*=...` sets every role not named. CHECKPOINT is `best`, `latest`, `step_N` or
`N`; POLICY (the run's adapter) may be left out when the run has one adapter or one named
after the role. Roles not named are served by the base model.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from marl.models.engines import resolve_engine
from marl.runtime import auth
from marl.spec.run import RunSpec, SpecError, load_spec_text

BASE = "base"


@dataclass(frozen=True)
class AdapterSource:
    """What serves one role: a saved adapter (checkpoint dir + policy) or the base model."""

    ckpt: Path | None
    policy: str | None = None
    step: int = 0

    @property
    def label(self) -> str:
        if self.ckpt is None:
            return BASE
        return f"{self.ckpt.parent.parent.name}@{self.ckpt.name}:{self.policy}"


def run_spec(run_dir: Path) -> RunSpec:
    path = run_dir / "run.yaml"
    if not path.is_file():
        raise SpecError(f"{run_dir}: no run.yaml; pass the output directory of a marl run")
    return load_spec_text(path.read_text())


def checkpoint_dir(run_dir: Path, name: str) -> Path:
    """RUN_DIR's checkpoint `best`, `latest`, `step_N` or `N`."""
    root = run_dir / "checkpoints"
    if name == "latest" and (root / "latest").is_file():
        name = (root / "latest").read_text().strip()
    elif name.isdigit():
        name = f"step_{int(name):06d}"
    elif name.startswith("step_") and name[5:].isdigit():
        name = f"step_{int(name[5:]):06d}"
    path = root / name
    if not (path / "adapters").is_dir():
        have = sorted(p.name for p in root.glob("*") if (p / "adapters").is_dir())
        raise SpecError(
            f"{run_dir}: no checkpoint {name!r}; it has {', '.join(have) or 'none'} "
            "(use best, latest, step_N or N)"
        )
    return path


def source(text: str, role: str) -> AdapterSource:
    """`base` or `RUN_DIR@CHECKPOINT[:POLICY]` for `role`."""
    if text == BASE:
        return AdapterSource(None)
    run, _, rest = text.rpartition("@")
    if not run:
        raise SpecError(
            f"--adapters {role}={text}: expected RUN_DIR@CHECKPOINT[:POLICY] or base, "
            f"e.g. {role}=runs/demo@best"
        )
    ckpt_name, _, policy = rest.partition(":")
    ckpt = checkpoint_dir(Path(run), ckpt_name)
    have = sorted(p.name for p in (ckpt / "adapters").iterdir() if p.is_dir())
    if not policy:
        if len(have) == 1:
            policy = have[0]
        elif role in have:
            policy = role
        else:
            raise SpecError(
                f"--adapters {role}={text}: that checkpoint holds adapters {', '.join(have)}; "
                f"name one: {role}={run}@{ckpt_name}:{have[0]}"
            )
    if policy not in have:
        raise SpecError(
            f"--adapters {role}={text}: no adapter {policy!r} in {ckpt}; it has {', '.join(have)}"
        )
    state = ckpt / "state.json"
    step = int(json.loads(state.read_text())["step"]) if state.is_file() else 0
    return AdapterSource(ckpt.resolve(), policy, step)


def parse_routing(text: str, roles: list[str]) -> dict[str, AdapterSource]:
    """`--adapters` for a workflow with these roles: role -> source (base where not named)."""
    named: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        role, eq, value = item.partition("=")
        if not eq or not value:
            raise SpecError(f"--adapters: {item!r} is not ROLE=RUN_DIR@CHECKPOINT or ROLE=base")
        if role != "*" and role not in roles:
            raise SpecError(
                f"--adapters: the workflow has no role {role!r}; its roles are {', '.join(roles)}"
            )
        named[role] = value
    default = named.pop("*", BASE)
    return {role: source(named.get(role, default), role) for role in roles}


def routing_of_run(
    run_dir: Path, checkpoint: str, spec: RunSpec | None = None
) -> dict[str, AdapterSource]:
    """Every role served by the adapter it trained in RUN_DIR, at `checkpoint`."""
    from marl.workflows.routing import policy_of_role

    spec = spec or run_spec(run_dir)
    return {
        role: source(f"{run_dir}@{checkpoint}:{policy}", role)
        for role, policy in policy_of_role(spec).items()
    }


SOLVER_ROLES = ("generator", "worker")
"""The role that solves the problem as the single agent does, by preference: Orch-Workers has
no generator, and its workers take the SA-RL adapter in Table 3 (read literally, the paper's
A.2 puts the workers on the base model too, leaving Orch-Workers with no adapter at all)."""


def solver_role(spec: RunSpec) -> str | None:
    """The role of `spec`'s workflow that Table 3 serves with the SA-RL adapter."""
    from marl.workflows.routing import policy_of_role

    roles = policy_of_role(spec)
    return next((r for r in SOLVER_ROLES if r in roles), None)


def generator_transfer(
    spec: RunSpec, sa_rl_dir: Path, checkpoint: str = "latest"
) -> dict[str, AdapterSource]:
    """Paper Table 3's routing for `spec`'s workflow: the single-agent RL run's adapter (its
    one policy, at `checkpoint`) on the generator role (`solver_role`), the base model on
    every other."""
    from marl.workflows.routing import policy_of_role

    roles = list(policy_of_role(spec))
    role = solver_role(spec)
    if role is None:
        raise SpecError(
            f"workflow {spec.workflow} has no {' or '.join(SOLVER_ROLES)} role to serve with "
            f"the SA-RL adapter; its roles are {', '.join(roles)}"
        )
    return parse_routing(f"{role}={sa_rl_dir}@{checkpoint}", roles)


# ---------------------------------------------------------------- payloads


def _checkpoint_payload(src: AdapterSource) -> tuple[bytes, dict[str, Any]]:
    assert src.ckpt is not None and src.policy is not None
    folder = src.ckpt / "adapters" / src.policy
    config = json.loads((folder / "adapter_config.json").read_text())
    return (folder / "adapter_model.safetensors").read_bytes(), config


def _zero_payload(spec: RunSpec, like: AdapterSource | None) -> tuple[bytes, dict[str, Any]]:
    """A LoRA adapter of all zeros: the base model. Shaped like a saved adapter where there is
    one, else like the adapter the spec's `lora` makes on its model."""
    import torch

    from marl.protocol import adapter_io

    if like is not None:
        payload, config = _checkpoint_payload(like)
        state = adapter_io.deserialize(payload)
        return adapter_io.serialize({k: torch.zeros_like(v) for k, v in state.items()}), config
    from peft import get_peft_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    from marl.models.lora import with_lora

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(spec.model.path))
    peft = with_lora(model, spec.lora)
    state = {
        k: torch.zeros(v.shape, dtype=torch.float32)
        for k, v in get_peft_model_state_dict(peft).items()
    }
    config = {
        "r": spec.lora.rank,
        "lora_alpha": spec.lora.alpha,
        "target_modules": sorted(lora_targets(peft.peft_config["default"])),
    }
    return adapter_io.serialize(state), config


def lora_targets(config: Any) -> list[str]:
    return list(config.target_modules)


def _payload(
    src: AdapterSource, spec: RunSpec, like: AdapterSource | None
) -> tuple[bytes, dict[str, Any]]:
    return _zero_payload(spec, like) if src.ckpt is None else _checkpoint_payload(src)


# ---------------------------------------------------------------- evaluation


async def _push(
    r: Any, name: str, base_model: str, payload: bytes, config: dict[str, Any]
) -> list[str]:
    """Push `name`@1 to every serving replica of the base model; their addresses."""

    from marl.protocol import adapter_io
    from marl.protocol.v1 import inference_pb2_grpc
    from marl.runtime import replicas

    live = await replicas.live(r, "inference")
    targets = [i["address"] for i in live.values() if i.get("base_model") == base_model]
    if not targets:
        raise RuntimeError(
            f"no serving inference replica holds base model {base_model}; start one "
            "with the spec's model.path"
        )
    manifest = adapter_io.make_manifest(
        name,
        1,
        base_model,
        int(config["r"]),
        float(config["lora_alpha"]),
        sorted(config["target_modules"]),
        payload,
    )
    for address in targets:
        async with auth.aio_channel(address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            await stub.PushAdapter(adapter_io.chunks(manifest, payload), timeout=300)
    return targets


async def _unload(addresses: list[str], names: list[str]) -> None:
    import grpc

    from marl.protocol.v1 import common_pb2, inference_pb2, inference_pb2_grpc

    for address in addresses:
        async with auth.aio_channel(address) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            for name in names:
                try:
                    await stub.UnloadAdapter(
                        inference_pb2.UnloadAdapterRequest(
                            ref=common_pb2.AdapterRef(name=name, version=1)
                        ),
                        timeout=30,
                    )
                except grpc.aio.AioRpcError:
                    pass  # replica gone or adapter already dropped: nothing to free


async def evaluate(
    spec: RunSpec, routing: dict[str, AdapterSource], redis_url: str, step: int | None = None
) -> dict[str, Any]:
    """The validation metrics (`val/accuracy`, ...) of `spec`'s workflow with each role
    served as `routing` says. `step` (default: the newest checkpoint's step among the
    sources) only seeds sampling, as in the run that made the checkpoint."""
    import redis.asyncio as aioredis

    from marl.data import load_problems
    from marl.models.identity import base_model_id
    from marl.rollout import AdapterRef
    from marl.spec.services import LearnerConfig
    from services.learner.episodes import Episodes
    from services.learner.validator import Validator

    eval_id = f"eval-{uuid.uuid4().hex[:10]}"
    base_model = base_model_id(spec.model.path)
    like = next((s for s in routing.values() if s.ckpt is not None), None)
    labels = sorted({s.label for s in routing.values()})
    names = {label: f"{eval_id}/{i}" for i, label in enumerate(labels)}
    r = aioredis.from_url(redis_url, decode_responses=True)
    addresses: list[str] = []
    try:
        for label in labels:
            src = next(s for s in routing.values() if s.label == label)
            payload, config = await asyncio.to_thread(_payload, src, spec, like)
            addresses = await _push(r, names[label], base_model, payload, config)
        refs = {role: AdapterRef(names[s.label], 1) for role, s in routing.items()}

        async def never_cancelled() -> None:
            return None

        class Recorded(Episodes):
            rollouts: list[Any] = []

            async def run(self, problems: list[Any], step: int, kind: str, *more: Any) -> list[Any]:
                self.rollouts = await super().run(problems, step, kind, *more)
                return self.rollouts

        queued = LearnerConfig().max_queued_tasks  # the bound a learner has by default
        episodes = Recorded(eval_id, spec, r, "eval", lambda: refs, never_cancelled, queued)
        await episodes.open(fresh=True)
        problems = load_problems(spec.data, "val", spec.seed)[: spec.train.val_problems]
        at = step if step is not None else max((s.step for s in routing.values()), default=0)
        metrics = await Validator(problems, 1, 1, episodes).run(at)
        await episodes.close()
        errors = [x.error for x in episodes.rollouts if x.error is not None]
        if errors:
            # scored as the learner's validation scores them, but say why
            metrics["val/first_episode_error"] = errors[0]
        return metrics
    finally:
        await _unload(addresses, list(names.values()))
        await r.aclose()


def evaluate_sync(
    spec: RunSpec, routing: dict[str, AdapterSource], redis_url: str, step: int | None = None
) -> dict[str, Any]:
    return asyncio.run(evaluate(spec, routing, redis_url, step))


# ---------------------------------------------------------------- attribution


def attribute(run_dir: Path, checkpoint: str, baseline: str, redis_url: str) -> dict[str, Any]:
    """Validation accuracy of the trained workflow, of it with each role in turn served by
    `baseline` (`base` or an earlier checkpoint of the same run), and with every role so."""
    spec = run_spec(run_dir)
    trained = routing_of_run(run_dir, checkpoint, spec)
    if baseline == BASE:
        before = {role: AdapterSource(None) for role in trained}
    else:
        before = routing_of_run(run_dir, baseline, spec)
    step = max(s.step for s in trained.values())
    errors = 0

    def accuracy(routing: dict[str, AdapterSource], at: int | None) -> float:
        nonlocal errors
        metrics = evaluate_sync(spec, routing, redis_url, at)
        errors += int(metrics["val/episode_errors"])
        return float(metrics["val/accuracy"])

    full = accuracy(trained, step)
    rows = []
    for role in trained:
        acc = accuracy({**trained, role: before[role]}, step)
        rows.append({"role": role, "accuracy_without": acc, "contribution": full - acc})
    none = accuracy(before, 0 if baseline == BASE else None)
    return {
        "episode_errors": errors,
        "run_dir": str(run_dir),
        "checkpoint": checkpoint,
        "baseline": baseline,
        "accuracy": full,
        "accuracy_baseline": none,
        "roles": rows,
    }


def format_attribution(result: dict[str, Any]) -> str:
    lines = [
        f"{result['run_dir']} @ {result['checkpoint']}: validation accuracy "
        f"{result['accuracy']:.3f}; every role served by {result['baseline']}: "
        f"{result['accuracy_baseline']:.3f}",
        f"{'role':<16} {'acc. with role -> ' + result['baseline']:>28} {'contribution':>13}",
    ]
    for row in result["roles"]:
        lines.append(
            f"{row['role']:<16} {row['accuracy_without']:>28.3f} {row['contribution']:>+13.3f}"
        )
    if result.get("episode_errors"):
        lines.append(f"warning: {result['episode_errors']} episodes failed and scored 0")
    return "\n".join(lines)


# ---------------------------------------------------------------- embedded cluster


class EvalCluster:
    """Redis + inference + workflow worker (no learner) for `marl eval/attribute` when no
    `--redis` is given."""

    def __init__(self, workdir: Path, spec: RunSpec):
        from marl.local.launcher import Cluster
        self.cluster = Cluster(
            workdir,
            spec.model.path,
            engine=resolve_engine(spec.engine),
            learner=False,
            max_lora_rank=max(spec.lora.rank, 64),
        )

    def __enter__(self) -> str:
        endpoints = self.cluster.start()
        return str(endpoints["redis"])

    def __exit__(self, *exc: object) -> None:
        self.cluster.stop()
