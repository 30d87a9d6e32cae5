"""Checkpoints' DCP state is read as data only, and the layout before DCP still loads.

DCP's `.metadata` is a pickle: a checkpoint directory someone else wrote must not run
code when a learner resumes from it (services/learner/dcp_state.py).
"""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from services.learner import checkpoint, dcp_state
from services.learner.policy import MultiAdapterPolicy
from services.learner.update import grpo_step
from tests.support.batches import ROLES, new_policy, spec, voting_batch

OS_SYSTEM = b"cos\nsystem\n(S'touch %s'\ntR."
"""A protocol-0 pickle that calls os.system (touching a file) when loaded."""


def losses(policy: MultiAdapterPolicy, seed: int) -> list[float]:
    s = spec(mini_batch_size=2, micro_batch_sequences=3)
    rollouts = voting_batch(seed)
    result = grpo_step(policy, rollouts, [r.problem_id for r in rollouts], ROLES["isolated"], s)
    return [m.loss for m in result.mini_batches]


def trained(model_dir: Path) -> MultiAdapterPolicy:
    policy = new_policy(model_dir, "isolated", spec())
    losses(policy, 0)
    return policy


def test_deny_metadata_that_names_os_system(model_dir: Path, tmp_path: Path) -> None:
    ckpt = checkpoint.save(tmp_path, 1, trained(model_dir), {"data_position": 0})
    marker = tmp_path / "ran"
    (ckpt / "dcp" / ".metadata").write_bytes(OS_SYSTEM % str(marker).encode())

    with pytest.raises(dcp_state.UnsafeCheckpoint, match=r"names os\.system.*never code"):
        checkpoint.load(ckpt, new_policy(model_dir, "isolated", spec()))
    assert not marker.exists()


def test_deny_bytes_entries_which_dcp_would_unpickle(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.zeros(2), "note": "text"}, checkpoint_id=tmp_path, no_dist=True)

    with pytest.raises(dcp_state.UnsafeCheckpoint, match="BytesStorageMetadata"):
        dcp_state.read_metadata(tmp_path / ".metadata")


def test_deny_a_shard_file_outside_the_checkpoint(model_dir: Path, tmp_path: Path) -> None:
    ckpt = checkpoint.save(tmp_path, 1, trained(model_dir), {"data_position": 0})
    meta = dcp_state.read_metadata(ckpt / "dcp" / ".metadata")
    for info in meta.storage_data.values():
        info.relative_path = "../../elsewhere.distcp"
    import pickle

    (ckpt / "dcp" / ".metadata").write_bytes(pickle.dumps(meta))

    with pytest.raises(dcp_state.UnsafeCheckpoint, match="outside its directory"):
        dcp_state.read_metadata(ckpt / "dcp" / ".metadata")


def test_allow_a_checkpoint_this_learner_wrote(model_dir: Path, tmp_path: Path) -> None:
    ckpt = checkpoint.save(tmp_path, 1, trained(model_dir), {"data_position": 0})

    meta = dcp_state.read_metadata(ckpt / "dcp" / ".metadata")
    assert any(k.endswith("/exp_avg_sq") for k in meta.state_dict_metadata)
    assert sorted(p.name for p in (ckpt / "dcp").iterdir()) == [".metadata", "__0_0.distcp"]


def write_whole_layout(ckpt: Path, policy: MultiAdapterPolicy, step: int) -> None:
    """A checkpoint as the learner wrote it before DCP: whole weights and optimizer states."""
    for p in policy.policies:
        folder = checkpoint.adapter_dir(ckpt, p)
        folder.mkdir(parents=True)
        save_file(policy.state_dict(p), str(folder / "adapter_model.safetensors"))
        policy.model.peft_config[p].save_pretrained(str(folder))
        torch.save(
            {"optimizer": policy.optimizer_state(p), "scheduler": policy.schedulers[p].state_dict()},
            ckpt / f"optimizer_{p}.pt",
        )
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, ckpt / "rng.pt")
    (ckpt / "state.json").write_text(json.dumps(
        {"step": step, "updates": policy.updates, "adapters": policy.policies, "data_position": 0}
    ))


def test_a_checkpoint_of_the_layout_before_dcp_still_resumes(
    model_dir: Path, tmp_path: Path
) -> None:
    one = trained(model_dir)
    write_whole_layout(tmp_path, one, 1)
    want = losses(one, 1)

    fresh = new_policy(model_dir, "isolated", spec())
    state = checkpoint.load(tmp_path, fresh)

    assert state["step"] == 1 and fresh.updates == 1
    assert losses(fresh, 1) == pytest.approx(want, rel=1e-5, abs=1e-7)
