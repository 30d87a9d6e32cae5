"""FSDP2 on two CPU processes (gloo) trains exactly as one process does.

The same Isolated-Policy Voting batch, a tiny real PEFT model: one GRPO step in this
process, and one through `RankedPolicy` with `learner.world_size` 2. Each 8-sequence
mini-batch packs into micro-batches of 3, 3 and 2 sequences, which two ranks cannot
split evenly, so one rank also runs a filler forward; three generator mini-batches make
the later ones off-policy. Loss, every per-role signal and both updated adapters must agree.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from marl.spec.run import RunSpec
from services.learner import checkpoint
from services.learner.ranks import PolicyArgs, RankedPolicy, RankFailed
from services.learner.update import grpo_step
from tests.support.batches import ROLES, new_policy, spec, voting_batch


def ranked(model_dir: Path, s: RunSpec, world_size: int = 2) -> RankedPolicy:
    args = PolicyArgs(
        str(model_dir), ["aggregator", "generator"], s.lora, s.optim, 10, "float32", 0, "cpu"
    )
    return RankedPolicy.start(args, world_size)


def test_two_ranks_give_the_loss_and_adapters_of_one_process(
    model_dir: Path, tmp_path: Path
) -> None:
    s = spec(mini_batch_size=2, micro_batch_sequences=3)
    s = s.model_copy(update={"optim": s.optim.model_copy(update={"lr": 0.01})})
    rollouts = voting_batch()
    groups = [r.problem_id for r in rollouts]

    one = new_policy(model_dir, "isolated", s)
    want = grpo_step(one, rollouts, groups, ROLES["isolated"], s)

    two = ranked(model_dir, s)
    try:
        assert two.call(lambda_free_world_size) == 2
        got = two.call(grpo_step, rollouts, groups, ROLES["isolated"], s)
        states = {p: two.state_dict(p) for p in one.policies}
        checkpoint.save(tmp_path, 1, two, {"data_position": 0})
    finally:
        two.close()

    assert [(m.policy, m.sequences) for m in got.mini_batches] == [
        (m.policy, m.sequences) for m in want.mini_batches
    ]
    assert [m.loss for m in got.mini_batches] == pytest.approx(
        [m.loss for m in want.mini_batches], rel=1e-5, abs=1e-7
    )
    assert [m.grad_norm for m in got.mini_batches] == pytest.approx(
        [m.grad_norm for m in want.mini_batches], rel=1e-5
    )
    for key, value in want.metrics.items():
        if key.startswith("time/"):
            continue
        assert got.metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    for p in one.policies:
        mine = one.state_dict(p)
        assert any(v.abs().sum() > 0 for k, v in mine.items() if "lora_B" in k)
        for k, v in mine.items():
            torch.testing.assert_close(states[p][k], v, rtol=1e-5, atol=1e-7)

    # the ranks' checkpoint is whole: one process resumes from it with the same state
    fresh = new_policy(model_dir, "isolated", s)
    checkpoint.load(tmp_path / "checkpoints" / "step_000001", fresh)
    for p in one.policies:
        for k, v in one.state_dict(p).items():
            torch.testing.assert_close(fresh.state_dict(p)[k], v, rtol=1e-5, atol=1e-7)
        a, b = fresh.optimizer_state(p)["state"], one.optimizer_state(p)["state"]
        assert a.keys() == b.keys()
        for i in a:
            torch.testing.assert_close(a[i]["exp_avg_sq"], b[i]["exp_avg_sq"], rtol=1e-4, atol=0)


def lambda_free_world_size(policy: object) -> int:
    return int(policy.world_size)  # type: ignore[attr-defined]


def fail_on_rank_one(policy: object) -> None:
    if policy.rank == 1:  # type: ignore[attr-defined]
        raise ValueError("rank one cannot")


def test_a_failing_rank_fails_the_call_and_stops_the_others(model_dir: Path) -> None:
    two = ranked(model_dir, spec())
    with pytest.raises(RankFailed, match="learner rank 1 failed: ValueError: rank one cannot"):
        two.call(fail_on_rank_one)
    assert not any(p.is_alive() for p in two.procs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_a_cuda_learner_without_a_gpu_is_refused_naming_the_field() -> None:
    from marl.spec.run import SpecError, parse_spec
    from services.learner.server import device_problem

    with pytest.raises(SpecError, match="field `learner.device`: cuda, but"):
        device_problem(parse_spec({"learner": {"device": "cuda"}}))
    device_problem(parse_spec({"learner": {"device": "auto", "world_size": 4}}))


def test_bf16_base_keeps_fp32_adapters_and_optimizer_state(model_dir: Path) -> None:
    """`model.dtype: bfloat16`: the frozen base in bf16, every adapter's LoRA weights (and
    so AdamW's moments) in fp32, and a step trains them."""
    from services.learner.policy import MultiAdapterPolicy

    s = spec(mini_batch_size=2)
    policy = MultiAdapterPolicy(
        str(model_dir), ["aggregator", "generator"], s.lora, s.optim, 10, "bfloat16"
    )
    lora = {p.dtype for n, p in policy.model.named_parameters() if "lora_" in n}
    base = {p.dtype for n, p in policy.model.named_parameters() if "lora_" not in n}
    assert lora == {torch.float32} and base == {torch.bfloat16}
    rollouts = voting_batch()
    result = grpo_step(policy, rollouts, [r.problem_id for r in rollouts], ROLES["isolated"], s)
    assert result.metrics["policy/generator/grad_norm"] > 0
    moments = policy.optimizer_state("generator")["state"]
    assert moments and {m["exp_avg"].dtype for m in moments.values()} == {torch.float32}
