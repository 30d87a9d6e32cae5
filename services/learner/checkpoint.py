"""Checkpoints a run resumes from, and that PEFT and vLLM load as they are.

`checkpoints/step_N/` holds, per adapter, a PEFT directory
`adapters/<policy>/{adapter_config.json, adapter_model.safetensors}`
(`PeftModel.from_pretrained(base, dir)`, vLLM `LoRARequest(name, id, dir)`); `dcp/`, the
adapters' weights and AdamW moments as every rank wrote its shards of them
(torch.distributed.checkpoint, dcp_state.py: they load at any world size);
`schedule_<policy>.pt`, its AdamW hyperparameters and LR-scheduler state; the RNG states;
and `state.json` (step, data position, adapter versions; with `routing`, role -> adapter,
only the adapters it names are saved, and `adapters` lists them: a run that split a role
off (guard.py) resumes with its routing, and its untrained spare adapters are not saved).
A checkpoint of the earlier layout (whole optimizer states in `optimizer_<policy>.pt`, no
`dcp/`) still loads. The ranks write `dcp/` into a temporary directory, each fsyncing
its files; once the last is done (the call returns: a barrier), the learner (rank 0)
writes the rest, fsyncs the tree and renames it into place, the parent fsynced, then
`latest` is replaced atomically and fsynced too: a learner killed at any point, or a node
that loses power, leaves the previous checkpoint whole and `latest` naming a checkpoint
whose bytes are on disk. `best` is a copy of the checkpoint with the best validation
accuracy; only the newest `train.checkpoints_kept` step checkpoints stay on disk.

`checkpoints/fence` holds the fencing token of the newest lease on the run
(marl.runtime.fences): a learner writes its token there when it takes the run
(`Checkpointer.claim`), and a save whose token is below the one written there is
refused before anything is renamed, so a learner that lost the run cannot move
`latest` under the one that holds it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from marl.runtime.fences import StaleFence
from services.learner import dcp_state
from services.learner.policy import MultiAdapterPolicy
from services.learner.ranks import PolicyHandle

DCP_DIR = "dcp"


def adapter_dir(ckpt: Path, policy: str) -> Path:
    return ckpt / "adapters" / policy


@dataclass
class Snapshot:
    """A checkpoint of the layout before `dcp/`, read whole onto the CPU: each adapter's
    weights, AdamW and scheduler states, and the RNG."""

    adapters: dict[str, dict[str, torch.Tensor]]
    optimizers: dict[str, dict[str, Any]]
    schedulers: dict[str, dict[str, Any]]
    updates: int
    rng: dict[str, Any]


def restore_snapshot(policy: MultiAdapterPolicy, snap: Snapshot) -> None:
    """Collective over the policy's ranks: call it through `PolicyHandle.call`."""
    for p in snap.adapters:
        policy.load_state_dict(p, snap.adapters[p])
        policy.load_optimizer_state(p, snap.optimizers[p])
        policy.schedulers[p].load_state_dict(snap.schedulers[p])
    _restore_rng(policy, snap.rng, snap.updates)


def _restore_rng(policy: MultiAdapterPolicy, rng: dict[str, Any], updates: int) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    policy.updates = updates


@dataclass
class Written:
    """What rank 0 returns once every rank wrote its shards: the rest of the checkpoint."""

    adapters: dict[str, dict[str, torch.Tensor]]
    """Whole weights, for the PEFT directories."""
    configs: dict[str, Any]
    schedules: dict[str, dict[str, Any]]
    updates: int
    rng: dict[str, Any]


def write_shards(policy: MultiAdapterPolicy, folder: str, names: list[str]) -> Written:
    """Collective over the policy's ranks: call it through `PolicyHandle.call`."""
    dcp_state.save(policy, folder, names)
    return Written(
        {p: policy.state_dict(p) for p in names},
        {p: policy.model.peft_config[p] for p in names},
        {
            p: {
                "param_groups": policy.optimizers[p].state_dict()["param_groups"],
                "scheduler": policy.schedulers[p].state_dict(),
            }
            for p in names
        },
        policy.updates,
        {"torch": torch.get_rng_state(), "python": random.getstate()},
    )


def read_shards(
    policy: MultiAdapterPolicy,
    folder: str,
    schedules: dict[str, dict[str, Any]],
    updates: int,
    rng: dict[str, Any],
) -> None:
    """Collective over the policy's ranks: call it through `PolicyHandle.call`."""
    names = list(schedules)
    dcp_state.load(policy, folder, names, {p: s["param_groups"] for p, s in schedules.items()})
    for p, s in schedules.items():
        policy.schedulers[p].load_state_dict(s["scheduler"])
    _restore_rng(policy, rng, updates)


def save(
    out_dir: Path,
    step: int,
    policy: PolicyHandle,
    state: dict[str, Any],
    fence: int | None = None,
) -> Path:
    """Write step `step`'s checkpoint and point `latest` at it. `fence`: the writer's
    fencing token; the save is refused (StaleFence) if the directory holds a newer one.
    Every rank writes its shards under `out_dir`, which they must all reach (one machine's
    disk, or storage shared by the learner's nodes)."""
    routing = state.get("routing")
    names = sorted(set(routing.values())) if routing else list(policy.policies)
    root = out_dir / "checkpoints"
    final = root / f"step_{step:06d}"
    tmp = root / f".step_{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    written = policy.call(write_shards, str(tmp / DCP_DIR), names)
    for p, weights in written.adapters.items():
        folder = adapter_dir(tmp, p)
        folder.mkdir(parents=True)
        save_file(weights, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
        written.configs[p].save_pretrained(str(folder))
        torch.save(written.schedules[p], tmp / f"schedule_{p}.pt")
    torch.save(written.rng, tmp / "rng.pt")
    (tmp / "state.json").write_text(
        json.dumps({**state, "step": step, "updates": written.updates, "adapters": names})
    )
    sync_tree(tmp)
    if fence is not None:
        check_fence(root, fence)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    sync_dir(root)
    _point(root, "latest", final.name)
    return final


def sync_tree(folder: Path) -> None:
    """fsync every file under `folder`, then every directory, deepest first: once this
    returns, a rename of `folder` publishes bytes that are on disk."""
    dirs = []
    for here, _subdirs, files in os.walk(folder):
        dirs.append(here)
        for name in files:
            fd = os.open(os.path.join(here, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for here in reversed(dirs):
        sync_dir(Path(here))


def sync_dir(folder: Path) -> None:
    """fsync a directory: the names created, renamed or removed in it are on disk."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _point(root: Path, name: str, target: str) -> None:
    tmp = root / f".{name}.tmp"
    with open(tmp, "w") as f:
        f.write(target)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / name)
    sync_dir(root)


FENCE_FILE = "fence"
"""In `checkpoints/`: the fencing token of the newest lease that wrote there."""


def written_fence(root: Path) -> int:
    """The fencing token written beside the run's checkpoints; 0 before any."""
    path = root / FENCE_FILE
    return int(path.read_text().strip() or 0) if path.exists() else 0


def check_fence(root: Path, fence: int) -> None:
    """StaleFence if a lease newer than `fence`'s wrote its token beside the checkpoints."""
    newest = written_fence(root)
    if newest > fence:
        raise StaleFence(
            f"checkpoints of {root.parent.name}: fencing token {fence} is stale (a learner "
            f"with token {newest} holds the run now); this checkpoint is not written"
        )


def load(ckpt: Path, policy: PolicyHandle) -> dict[str, Any]:
    """Restore `policy` from `ckpt`, written at whatever world size; its `state.json`."""
    state: dict[str, Any] = json.loads((ckpt / "state.json").read_text())
    names = state.get("adapters", policy.policies)
    if not (ckpt / DCP_DIR / dcp_state.METADATA).exists():
        return load_whole(ckpt, policy, state, names)
    schedules = {p: torch.load(ckpt / f"schedule_{p}.pt", weights_only=True) for p in names}
    rng = torch.load(ckpt / "rng.pt", weights_only=True)
    policy.call(read_shards, str(ckpt / DCP_DIR), schedules, int(state["updates"]), rng)
    return state


def load_whole(
    ckpt: Path, policy: PolicyHandle, state: dict[str, Any], names: list[str]
) -> dict[str, Any]:
    """A checkpoint of the layout before `dcp/`: whole weights and optimizer states."""
    adapters, optimizers, schedulers = {}, {}, {}
    for p in names:
        adapters[p] = load_file(str(adapter_dir(ckpt, p) / "adapter_model.safetensors"))
        states = torch.load(ckpt / f"optimizer_{p}.pt", weights_only=True)
        optimizers[p], schedulers[p] = states["optimizer"], states["scheduler"]
    rng = torch.load(ckpt / "rng.pt", weights_only=True)
    snap = Snapshot(adapters, optimizers, schedulers, int(state["updates"]), rng)
    policy.call(restore_snapshot, snap)
    return state


def load_latest(out_dir: Path, policy: PolicyHandle) -> dict[str, Any] | None:
    latest = out_dir / "checkpoints" / "latest"
    if not latest.exists():
        return None
    return load(out_dir / "checkpoints" / latest.read_text().strip(), policy)


class Checkpointer:
    """Decides when to checkpoint (every `interval` steps, at the end, and whenever
    validation beats the best so far), keeps `best` and prunes old checkpoints."""

    def __init__(
        self, out_dir: Path, interval: int, total_steps: int, keep: int, fence: int | None = None
    ):
        """`fence`: the fencing token of the lease this learner holds on the run (None:
        unfenced, a run no other learner takes)."""
        self.fence = fence
        self.root = out_dir / "checkpoints"
        self.out_dir = out_dir
        self.interval = interval
        self.total_steps = total_steps
        self.keep = keep
        self.best_accuracy = self._best_accuracy()

    def _best_accuracy(self) -> float | None:
        old = self.root / ".best.old"
        if not (self.root / "best").exists() and old.exists():
            os.replace(old, self.root / "best")  # killed between best's two renames
        state = self.root / "best" / "state.json"
        if not state.exists():
            return None
        value = json.loads(state.read_text()).get("val_accuracy")
        return None if value is None else float(value)

    def claim(self) -> None:
        """Write this learner's fencing token beside the checkpoints (StaleFence if a newer
        one is there): from now on a learner with an older token cannot save here."""
        if self.fence is None:
            return
        check_fence(self.root, self.fence)
        self.root.mkdir(parents=True, exist_ok=True)
        _point(self.root, FENCE_FILE, str(self.fence))

    def improves(self, val_accuracy: float | None) -> bool:
        return val_accuracy is not None and (
            self.best_accuracy is None or val_accuracy > self.best_accuracy
        )

    def due(self, step: int, val_accuracy: float | None) -> bool:
        return step % self.interval == 0 or step == self.total_steps or self.improves(val_accuracy)

    def save(
        self,
        step: int,
        policy: PolicyHandle,
        state: dict[str, Any],
        val_accuracy: float | None,
    ) -> Path:
        final = save(
            self.out_dir,
            step,
            policy,
            {**state, "val_accuracy": val_accuracy, "fence": self.fence},
            self.fence,
        )
        if self.improves(val_accuracy):
            tmp, old = self.root / ".best.tmp", self.root / ".best.old"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(old, ignore_errors=True)
            shutil.copytree(final, tmp)
            sync_tree(tmp)
            if (self.root / "best").exists():
                os.replace(self.root / "best", old)
            os.replace(tmp, self.root / "best")
            sync_dir(self.root)
            shutil.rmtree(old, ignore_errors=True)
            self.best_accuracy = val_accuracy
        self.prune()
        return final

    def prune(self) -> None:
        steps = sorted(p for p in self.root.glob("step_*") if p.is_dir())
        for old in steps[: -self.keep]:
            shutil.rmtree(old)
        for tmp in self.root.glob(".step_*.tmp"):
            shutil.rmtree(tmp, ignore_errors=True)

    def restore(self, policy: PolicyHandle) -> dict[str, Any] | None:
        return load_latest(self.out_dir, policy)
