"""The objective options beyond the paper's GRPO (KL, entropy, GSPO, RLOO, Dr. MAS, DAPO's
dynamic sampling and overlong band, pass@k), each against hand-worked numbers, and the
golden step: at the defaults a fixed step's metrics equal those recorded from the float64
step, in float32 and float64, on every CPU kernel set (GOLDEN_TOLERANCE says how close).
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch

from marl.rollout import AdapterRef, Rollout, Turn
from marl.spec.run import RunSpec, parse_spec
from services.learner.advantages import (
    group_advantages,
    overlong_penalty,
    sequence_advantages,
    shaped_rewards,
)
from services.learner.dynamic_sampling import dynamic_sampling, groups_with_signal
from services.learner.grpo import (
    clipped_loss,
    kl_penalty,
    pass_at_k,
    sequence_log_ratio,
)
from services.learner.policy import MultiAdapterPolicy
from services.learner.sequences import build_sequences
from services.learner.update import completion_logprobs
from tests.support.batches import ROLES, new_policy, spec, step, voting_batch

GOLDEN_TOLERANCE = {"rel": 1e-3, "abs": 1e-6}
"""How closely a golden step must reproduce, whatever the CPU. A float32 step's reductions
run in the order the kernel set (default, AVX2, AVX-512) chooses, so each sum carries
~1e-7 relative error of its own; two steps of four optimizer updates, and KL and χ²
estimates that subtract nearly equal log-probabilities, grow that to ~1e-5 relative across
kernel sets. 1e-3 leaves two orders of margin, and any change of what the step computes
(an aggregation, a clip bound, an advantage's normalisation) moves these values by percents."""

GOLDEN_LR = 1e-3
"""Small enough that the step is smooth in its inputs: at lr 0.5 the first Adam update
moves every LoRA weight by ±0.5, later mini-batches clip at both bounds, and a last-bit
difference in one kernel changes the second step's metrics by percents."""

GOLDEN = {
    # the float64 step on this file's model (transformers keeps its norms and rotary
    # embeddings in float32, so this is the exact step to ~1e-8, not to float64's last bit)
    "shared": {
        "0:policy/shared/loss": 0.0004018132561,
        "0:policy/shared/grad_norm": 0.5612313361,
        "0:policy/shared/update_chi2": 0.001956614223,
        "0:mb_loss[0]": -0.07924663139,
        "0:mb_loss[1]": 0.07851579392,
        "0:mb_loss[2]": 0.1276401408,
        "0:mb_loss[3]": -0.1253020503,
        "1:policy/shared/loss": -0.000256613089,
        "1:policy/shared/grad_norm": 0.5786884072,
        "1:policy/shared/update_chi2": 0.0007876412006,
        "1:mb_loss[0]": 0.1584932902,
        "1:mb_loss[1]": -0.4323588217,
        "1:mb_loss[2]": -0.03329242042,
        "1:mb_loss[3]": 0.3061314996,
        "shared:lora_B_abs_sum": 18.6907832,
    },
    "isolated": {
        "0:policy/aggregator/loss": 7.450580597e-09,
        "0:policy/aggregator/grad_norm": 0.629469611,
        "0:policy/aggregator/update_chi2": 0.00134920194,
        "0:policy/generator/loss": -0.0003963865199,
        "0:policy/generator/grad_norm": 0.5346624464,
        "0:policy/generator/update_chi2": 0.001397543529,
        "0:mb_loss[0]": 7.450580597e-09,
        "0:mb_loss[1]": 0.1707528731,
        "0:mb_loss[2]": -0.1256770073,
        "0:mb_loss[3]": -0.04626502536,
        "1:policy/aggregator/loss": 7.450580597e-09,
        "1:policy/aggregator/grad_norm": 0.7060757396,
        "1:policy/aggregator/update_chi2": 0.0005909397166,
        "1:policy/generator/loss": -0.0007486930302,
        "1:policy/generator/grad_norm": 0.5792891086,
        "1:policy/generator/update_chi2": 0.0005277064251,
        "1:mb_loss[0]": 7.450580597e-09,
        "1:mb_loss[1]": -0.1707528582,
        "1:mb_loss[2]": 0.4206760274,
        "1:mb_loss[3]": -0.2521692482,
        "aggregator:lora_B_abs_sum": 9.496432457,
        "generator:lora_B_abs_sum": 16.50146851,
    },
}


def golden_observation(model_dir: Path, mode: str, dtype: str) -> dict[str, float]:
    """The golden step's metrics, flat: per-policy loss, gradient norm and update χ² at both
    steps, every mini-batch's loss, and each adapter's Σ|B| (B starts at zero, so this is
    the update itself; A's initial values would swamp it). Two steps (voting_batch seeds 0
    and 1) at mini_batch_size 2: 4 optimizer steps a step under SP, the generator's 3 and
    the aggregator's 1 under IP, every one after the first off-policy."""
    s = spec(mini_batch_size=2)
    s = s.model_copy(update={"optim": s.optim.model_copy(update={"lr": GOLDEN_LR})})
    names = sorted(set(ROLES[mode].values()))
    policy = MultiAdapterPolicy(str(model_dir), names, s.lora, s.optim, total_steps=10, dtype=dtype)
    got: dict[str, float] = {}
    for k in range(2):
        result = step(policy, voting_batch(seed=k), mode, s)
        for name in names:
            for metric in ("loss", "grad_norm", "update_chi2"):
                key = f"policy/{name}/{metric}"
                got[f"{k}:{key}"] = float(result.metrics[key])
        for i, mb in enumerate(result.mini_batches):
            got[f"{k}:mb_loss[{i}]"] = float(mb.loss)
    for name in names:
        weights = policy.state_dict(name)
        got[f"{name}:lora_B_abs_sum"] = float(
            sum(t.double().abs().sum() for key, t in weights.items() if "lora_B" in key)
        )
    return got


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("mode", ["shared", "isolated"])
def test_golden_step_at_the_defaults(model_dir: Path, mode: str, dtype: str) -> None:
    """Two fixed steps at the defaults give the metrics and weights recorded from the
    float64 step, to GOLDEN_TOLERANCE on every CPU kernel set, in float32 and in float64."""
    got = golden_observation(model_dir, mode, dtype)
    assert got.keys() == GOLDEN[mode].keys()
    for key, want in GOLDEN[mode].items():
        assert got[key] == pytest.approx(want, **GOLDEN_TOLERANCE), key


BF16_TOLERANCE = {"rel": 1e-2, "abs": 2e-3}
"""How closely a bf16 golden step (`model.dtype: bfloat16`: base weights and matmuls in
bf16, LoRA weights, optimizer state and the log-softmax in float32) follows the float64
one, on every CPU kernel set. bf16 keeps 8 significant bits, so a product of O(1) values
is off by up to 2^-9 ≈ 2e-3: mini-batch losses of O(0.1-1) land within ~1e-3 absolute,
and a policy's loss, their mean of terms that cancel to ~1e-4, carries that as an
absolute error (hence `abs`); sums such as a gradient norm or Σ|B| stay within ~1e-3
relative. The emulated bf16 of the default kernel set (no AVX-512) rounds differently
from AVX-512's, which moves these values by as much again."""


@pytest.mark.parametrize("mode", ["shared", "isolated"])
def test_bf16_step_follows_the_golden_step(model_dir: Path, mode: str) -> None:
    got = golden_observation(model_dir, mode, "bfloat16")
    for key, want in GOLDEN[mode].items():
        assert got[key] == pytest.approx(want, **BF16_TOLERANCE), key


# --- KL to the base model ----------------------------------------------------------------


def test_kl_estimators_by_hand() -> None:
    # log r = log π_ref - log π = -0.5 and 1.0
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    assert kl_penalty(logp, ref, "k1").tolist() == pytest.approx([0.5, -1.0])
    assert kl_penalty(logp, ref, "k2").tolist() == pytest.approx([0.125, 0.5])
    assert kl_penalty(logp, ref, "k3").tolist() == pytest.approx(
        [math.exp(-0.5) - 1 + 0.5, math.e - 1 - 1.0]
    )
    # at π = π_ref every estimate and k3's gradient are 0
    same = torch.tensor([-0.7, -3.0], requires_grad=True)
    k3 = kl_penalty(same, same.detach(), "k3").sum()
    k3.backward()
    assert float(k3.detach()) == 0.0 and same.grad is not None and same.grad.abs().max() == 0


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_in_the_step_is_the_estimate_against_the_base_model(
    model_dir: Path, estimator: str
) -> None:
    """One mini-batch holds the whole step, so its forward is π before the update: the
    logged KL is Σ w·k(π, π_base) with seq-mean-token-mean weights, computed here apart
    with the adapter switched off for π_base."""
    s = spec(mini_batch_size=16, kl_coef=0.1, kl_estimator=estimator)
    policy = new_policy(model_dir, "shared", s)
    step(policy, voting_batch(seed=3), "shared", parse_spec_like(s))  # π leaves π_base
    batch = voting_batch(seed=4)
    seqs = build_sequences(batch, [0.0] * len(batch), ROLES["shared"])
    policy.activate("shared")
    with torch.no_grad():
        logp, _, lengths = completion_logprobs(policy, seqs, 1.0)
        base, _, _ = completion_logprobs(policy, seqs, 1.0, base=True)
    per_seq = [
        float(kl_penalty(a, b, estimator).mean())
        for a, b in zip(logp.split(lengths), base.split(lengths), strict=True)
    ]
    want = sum(per_seq) / len(per_seq)
    got = step(policy, batch, "shared", s).metrics["policy/shared/kl_ref"]
    assert want != 0
    assert got == pytest.approx(want, rel=1e-4, abs=1e-7)


def parse_spec_like(s: RunSpec) -> RunSpec:
    """`s` without the KL term: the warm-up step before the measured one."""
    return s.model_copy(update={"grpo": s.grpo.model_copy(update={"kl_coef": 0.0})})


# --- entropy bonus -------------------------------------------------------------------------


def test_entropy_with_gradient_by_hand() -> None:
    """Uniform logits over V tokens: H = ln V; `entropy_grad` keeps its graph."""
    from services.learner.policy import _chunk_logprobs

    h = torch.zeros(2, 4, requires_grad=True)
    lp, ent = _chunk_logprobs(lambda x: x, h, torch.tensor([0, 3]), 1.0, True, True)
    assert ent is not None and ent.requires_grad
    assert ent.tolist() == pytest.approx([math.log(4)] * 2)
    assert lp.tolist() == pytest.approx([-math.log(4)] * 2)
    _, no_grad = _chunk_logprobs(lambda x: x, h, torch.tensor([0, 3]), 1.0, True)
    assert no_grad is not None and not no_grad.requires_grad


def flat_batch() -> list[Rollout]:
    """Every group's rewards equal: every advantage 0, so the PPO term has no gradient."""
    out = voting_batch()
    for r in out:
        r.reward = 1.0
    return out


def test_entropy_bonus_alone_moves_the_policy_toward_more_entropy(model_dir: Path) -> None:
    flat = flat_batch()
    seqs = build_sequences(flat, [0.0] * len(flat), ROLES["shared"])

    def entropy(policy: MultiAdapterPolicy) -> float:
        policy.activate("shared")
        with torch.no_grad():
            _, ent, _ = completion_logprobs(policy, seqs, 1.0, entropy=True)
        assert ent is not None
        return float(ent.mean())

    plain = new_policy(model_dir, "shared", spec())
    before = {k: v.clone() for k, v in plain.state_dict("shared").items()}
    start = entropy(plain)
    step(plain, flat, "shared", spec(mini_batch_size=16))
    assert all(torch.equal(v, plain.state_dict("shared")[k]) for k, v in before.items())
    s = spec(mini_batch_size=16, entropy_coef=0.5)
    s = s.model_copy(update={"optim": s.optim.model_copy(update={"lr": 1e-2})})
    bonus = new_policy(model_dir, "shared", s)
    step(bonus, flat, "shared", s)
    assert entropy(bonus) > start


# --- GSPO ----------------------------------------------------------------------------------


def test_sequence_ratio_and_clip_by_hand() -> None:
    """Two sequences, log(π/π_old) = [0.1, 0.3 | -0.4], A = +1 | -1, clip 0.2 / 0.28,
    seq-mean-token-mean weights [1/4, 1/4 | 1/2]. Sequence level: s = e^0.2 (inside the
    clip) and e^-0.4 < 0.8 with A < 0 (clipped); token level: e^0.3 > 1.28 is clipped."""
    old = torch.tensor([-1.0, -1.0, -1.0])
    logp = (old + torch.tensor([0.1, 0.3, -0.4])).requires_grad_(True)
    adv = torch.tensor([1.0, 1.0, -1.0])
    w = torch.tensor([0.25, 0.25, 0.5])
    ones = torch.ones(3)
    seq, st = clipped_loss(logp, old, adv, ones, clip_low=0.2, clip_high=0.28, weights=w, seq_lengths=[2, 1])
    assert float(seq) == pytest.approx(-math.exp(0.2) * 0.5 + 0.8 * 0.5)
    assert (st.clipped_low, st.clipped_high) == (1, 0)
    seq.backward()
    assert logp.grad is not None
    # d/dlogp_t of -0.5 e^{mean} = -0.5 e^0.2 / 2 on each token of sequence 1; 0 on the clipped
    assert logp.grad.tolist() == pytest.approx([-0.25 * math.exp(0.2)] * 2 + [0.0])
    tok, st = clipped_loss(logp.detach(), old, adv, ones, clip_low=0.2, clip_high=0.28, weights=w)
    assert float(tok) == pytest.approx(-(math.exp(0.1) + 1.28) * 0.25 + 0.8 * 0.5)
    assert (st.clipped_low, st.clipped_high) == (1, 1)
    assert sequence_log_ratio(torch.tensor([0.1, 0.3, -0.4]), [2, 1]).tolist() == (
        pytest.approx([0.2, 0.2, -0.4])
    )


def test_sequence_ratio_is_one_on_policy(model_dir: Path) -> None:
    s = spec(mini_batch_size=16, ratio_level="sequence")
    result = step(new_policy(model_dir, "shared", s), voting_batch(), "shared", s)
    (mb,) = result.mini_batches
    assert mb.ratio_min == pytest.approx(1.0, abs=1e-6) == mb.ratio_max


# --- baselines and normalisation -----------------------------------------------------------


def test_leave_one_out_baseline_by_hand() -> None:
    # r - mean of the others: 1 - 1/3, 0 - 2/3, 0 - 2/3, 1 - 1/3
    adv = group_advantages([1, 0, 0, 1], ["g"] * 4, normalize_std=False, baseline="leave_one_out")
    assert adv == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    scaled = group_advantages([1, 0, 0, 1], ["g"] * 4, eps=0.0, baseline="leave_one_out")
    assert scaled == pytest.approx([a / math.sqrt(1 / 3) for a in adv])
    assert group_advantages([2, 2], ["g", "g"], baseline="leave_one_out") == [0.0, 0.0]


def rollout(pid: str, k: int, reward: float, roles: list[str]) -> Rollout:
    ref = AdapterRef("r/p", 0)
    turns = [Turn(role, s, [3, 4], [5, 6], [-1.0, -1.0], "stop", ref, "") for s, role in
             enumerate(roles)]
    return Rollout(f"{pid}:{k}", "r", 0, "train", pid, k, turns, "", reward)


def test_role_normalisation_by_hand() -> None:
    """Rewards 1, 0, 0; role a has 1, 2, 0 turns in them, role b 1, 0, 1. Role a's turns
    carry rewards 1, 0, 0 (mean 1/3, std sqrt(1/3)), role b's 1, 0 (mean 1/2, std
    sqrt(1/2)). Under `workflow` every turn of a rollout has its rollout's advantage."""
    rollouts = [
        rollout("p", 0, 1.0, ["a", "b"]),
        rollout("p", 1, 0.0, ["a", "a"]),
        rollout("p", 2, 0.0, ["b"]),
    ]
    s = parse_spec({"workflow": "voting", "grpo": {"advantage_norm": "role"}})
    got = sequence_advantages(rollouts, [1.0, 0.0, 0.0], ["p"] * 3, s.grpo)
    a, b = math.sqrt(1 / 3), math.sqrt(1 / 2)
    assert got == pytest.approx(
        [(2 / 3) / a, 0.5 / b, (-1 / 3) / a, (-1 / 3) / a, -0.5 / b], rel=1e-5
    )
    assert sequence_advantages(rollouts, [1.0, 0.0, 0.0], ["p"] * 3, RunSpec().grpo) is None


# --- DAPO: overlong band and dynamic sampling ----------------------------------------------


def test_overlong_band_by_hand() -> None:
    # cap 20, band 4: free up to 16, then -1/4 per token, -1 at (and past) the cap
    got = [overlong_penalty(n, 20, 4, 1.0) for n in (10, 16, 17, 18, 20, 25)]
    assert got == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    assert overlong_penalty(18, 20, 4, 0.5) == pytest.approx(-0.25)
    assert overlong_penalty(20, 20, 0, 1.0) == 0.0


def test_overlong_penalty_takes_each_rollouts_longest_turn() -> None:
    s = parse_spec({"sampling": {"max_tokens": 8}, "grpo": {"overlong": 4}})
    short = rollout("p", 0, 1.0, ["a"])
    long = rollout("p", 1, 1.0, ["a", "b"])
    long.turns[1].completion_ids = [7] * 7  # 7 tokens: 3 into the band (8 - 4 = 4 free)
    assert shaped_rewards([short, long], s) == pytest.approx([1.0, 1.0 - 0.75])
    assert shaped_rewards([short, long], RunSpec()) == [1.0, 1.0]


def group(pid: str, rewards: list[float]) -> list[Rollout]:
    return [rollout(pid, k, r, ["a"]) for k, r in enumerate(rewards)]


def test_dynamic_sampling_tops_up_until_the_step_is_full() -> None:
    """3 problems a step: a has signal, b and c none -> 2 more: d (signal), e (none) -> 1
    more: f (signal). The step trains a, d, f; 3 of the 6 groups sampled were dropped."""
    s = parse_spec({"train": {"problems_per_step": 3}, "grpo": {"dynamic_sampling": True}})
    queue = [group("d", [1, 0]), group("e", [0, 0]), group("f", [0, 1]), group("g", [1, 0])]
    asked = []

    async def more(n: int) -> list[Rollout]:
        asked.append(n)
        return [r for _ in range(n) for r in queue.pop(0)]

    first = group("a", [1, 0]) + group("b", [1, 1]) + group("c", [0, 0])
    everything, trained, record = asyncio.run(dynamic_sampling(first, more, s))
    assert asked == [2, 1]
    assert {r.problem_id for r in trained} == {"a", "d", "f"}
    assert len(everything) == 12
    assert record == {
        "train/dynamic_sampling_dropped": pytest.approx(3 / 6),
        "train/dynamic_sampling_rounds": 2,
        "train/dynamic_sampling_groups": 3,
    }


def test_dynamic_sampling_is_bounded() -> None:
    """Every top-up has no signal: after `dynamic_sampling_rounds` the step trains what it
    has (one group)."""
    s = parse_spec(
        {
            "train": {"problems_per_step": 4},
            "grpo": {"dynamic_sampling": True, "dynamic_sampling_rounds": 2},
        }
    )
    asked = []

    async def more(n: int) -> list[Rollout]:
        asked.append(n)
        return [r for k in range(n) for r in group(f"x{len(asked)}{k}", [1, 1])]

    first = group("a", [1, 0]) + group("b", [1, 1]) + group("c", [0, 0]) + group("d", [0, 0])
    _, trained, record = asyncio.run(dynamic_sampling(first, more, s))
    assert asked == [3, 3]
    assert {r.problem_id for r in trained} == {"a"}
    assert record["train/dynamic_sampling_rounds"] == 2
    assert record["train/dynamic_sampling_dropped"] == pytest.approx(9 / 10)


def test_dynamic_sampling_counts_failed_episodes_out() -> None:
    """A group whose only differing rollout failed has no signal; shaped rewards count."""
    s = parse_spec({"train": {"problems_per_step": 1}, "grpo": {"dynamic_sampling": True}})
    failed = group("a", [1, 0, 0])
    failed[0].error = "sandbox down"
    assert groups_with_signal(failed + group("b", [0, 1]), s) == ["b"]


# --- pass@k --------------------------------------------------------------------------------


def test_pass_at_k_by_hand() -> None:
    # n = 5, c = 2: pass@1 = 2/5; pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10; pass@4 = 1 (C(3,4) = 0)
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(5, 2, 4) == 1.0
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(4, 4, 4) == 1.0


def test_validation_pass_at_over_problems() -> None:
    """p: 1 of 3 samples correct, q: 3 of 3, r: 0 of 3 (one failed episode left out);
    pass@1 = mean(1/3, 1, 0), pass@2 = mean(1 - C(2,2)/C(3,2), 1, 0); r has 2 samples, so
    pass@3 averages p and q alone."""
    from services.learner.validator import pass_at

    rollouts = group("p", [1, 0, 0]) + group("q", [1, 1, 1]) + group("r", [0, 0, 0])
    rollouts[-1].error = "no replica"
    got = pass_at(rollouts, [1, 2, 3])
    assert got == {
        "val/pass@1": pytest.approx((1 / 3 + 1 + 0) / 3),
        "val/pass@2": pytest.approx((2 / 3 + 1 + 0) / 3),
        "val/pass@3": pytest.approx((1 + 1) / 2),
    }
