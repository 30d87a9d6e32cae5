"""Checkpoints: PEFT directories, exact resume, best and retention, a SIGKILL mid-write."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from marl.spec.run import LoraSpec, OptimSpec
from services.learner import checkpoint
from services.learner.checkpoint import Checkpointer
from services.learner.policy import MultiAdapterPolicy
from tests.support.batches import new_policy, spec, step, voting_batch


def test_adapter_dir_loads_with_peft_and_gives_the_learners_greedy_tokens(
    model_dir: Path, tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    s = spec(mini_batch_size=4)
    policy = new_policy(model_dir, "isolated", s)
    step(policy, voting_batch(), "isolated", s)
    ckpt = checkpoint.save(tmp_path, 1, policy, {"data_position": 0})
    folder = checkpoint.adapter_dir(ckpt, "generator")
    assert sorted(p.name for p in folder.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"
    ]
    prompt = torch.tensor([[5, 9, 17, 23, 30, 41]])
    policy.activate("generator")
    policy.model.eval()
    with torch.no_grad():
        want_logits = policy.model(input_ids=prompt).logits
        want = policy.model.generate(input_ids=prompt, max_new_tokens=8, do_sample=False)
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), folder)
    loaded.eval()
    with torch.no_grad():
        got_logits = loaded(input_ids=prompt).logits
        got = loaded.generate(input_ids=prompt, max_new_tokens=8, do_sample=False)
        with loaded.disable_adapter():
            base_logits = loaded(input_ids=prompt).logits
    assert got.tolist() == want.tolist()
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=1e-5)
    assert not torch.allclose(base_logits, want_logits, atol=1e-3)  # the adapter is in it


def test_resumed_step_equals_the_uninterrupted_one(model_dir: Path, tmp_path: Path) -> None:
    """Adapters, AdamW moments, the LR schedule and the step count come back: the next
    step after a reload gives the same loss and the same weights, bit for bit."""
    s = spec(mini_batch_size=4).model_copy(deep=True)
    s.optim.schedule = "cosine"
    s.optim.warmup_steps = 2
    a = new_policy(model_dir, "shared", s)
    step(a, voting_batch(seed=0), "shared", s)
    checkpoint.save(tmp_path, 1, a, {"data_position": 4})
    first = step(a, voting_batch(seed=1), "shared", s)

    b = new_policy(model_dir, "shared", s)
    state = checkpoint.load_latest(tmp_path, b)
    assert state is not None and state["step"] == 1 and b.updates == 1
    again = step(b, voting_batch(seed=1), "shared", s)
    assert again.metrics["policy/shared/loss"] == first.metrics["policy/shared/loss"]
    assert again.metrics["train/lr"] == first.metrics["train/lr"]
    for k, v in a.state_dict("shared").items():
        assert torch.equal(v, b.state_dict("shared")[k]), k


def test_best_follows_validation_and_old_checkpoints_go(model_dir: Path, tmp_path: Path) -> None:
    s = spec()
    policy = new_policy(model_dir, "shared", s)
    ck = Checkpointer(tmp_path, interval=5, total_steps=20, keep=2)
    assert ck.due(5, None) and not ck.due(3, None)
    assert ck.due(3, 0.1)  # a first validation is the best so far
    for n, acc in [(1, 0.1), (2, 0.5), (3, 0.3), (4, None)]:
        ck.save(n, policy, {"data_position": n}, acc)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000003", "step_000004"]
    best = json.loads((root / "best" / "state.json").read_text())
    assert (best["step"], best["val_accuracy"]) == (2, 0.5)
    assert not ck.due(7, 0.4) and ck.due(7, 0.6)
    # a new learner reads the best accuracy back
    assert Checkpointer(tmp_path, 5, 20, 2).best_accuracy == 0.5


CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from marl.spec.run import LoraSpec, OptimSpec
    from services.learner import checkpoint
    from services.learner.policy import MultiAdapterPolicy

    out, model = Path(sys.argv[1]), sys.argv[2]
    policy = MultiAdapterPolicy(model, ["a", "b"], LoraSpec(rank=2, alpha=4), OptimSpec(), 10)
    checkpoint.save(out, 1, policy, {"data_position": 1})
    real = checkpoint.save_file

    def slow(*args, **kwargs):
        real(*args, **kwargs)
        print("writing", flush=True)
        time.sleep(120)

    checkpoint.save_file = slow
    policy.updates = 2
    checkpoint.save(out, 2, policy, {"data_position": 2})
    """
)


def test_sigkill_during_a_checkpoint_write_leaves_the_last_one_whole(
    model_dir: Path, tmp_path: Path
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path), str(model_dir)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "writing"  # half of step 2 is on disk
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    root = tmp_path / "checkpoints"
    assert (root / ".step_000002.tmp").exists()
    assert (root / "latest").read_text() == "step_000001"
    policy = MultiAdapterPolicy(str(model_dir), ["a", "b"], LoraSpec(rank=2, alpha=4),
                                OptimSpec(), 10)
    state = checkpoint.load_latest(tmp_path, policy)
    assert state is not None and (state["step"], state["data_position"]) == (1, 1)
    Checkpointer(tmp_path, 1, 10, 3).save(2, policy, {"data_position": 2}, None)
    assert not list(root.glob(".step_*.tmp"))
    assert (root / "latest").read_text() == "step_000002"


class _Planted:
    """What a checkpoint loaded with pickle would run: `__reduce__` calls anything."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("touch planted-by-checkpoint",))


def test_a_checkpoint_is_read_as_data_never_as_code(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file placed where the learner reads its checkpoint (an AdamW schedule holding a
    pickled callable) is refused (torch.load weights_only): nothing it names runs. DCP's
    own metadata: tests/unit/test_dcp_checkpoint.py."""
    import pickle

    s = spec(mini_batch_size=4)
    policy = new_policy(model_dir, "shared", s)
    ckpt = checkpoint.save(tmp_path, 1, policy, {"data_position": 0})
    torch.save({"param_groups": _Planted(), "scheduler": {}}, ckpt / "schedule_shared.pt")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        checkpoint.load_latest(tmp_path, new_policy(model_dir, "shared", s))
    assert not (tmp_path / "planted-by-checkpoint").exists()
