"""Per-role training signals against numbers worked out by hand."""

from __future__ import annotations

import math
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from services.learner import diagnostics
from services.learner.diagnostics import RoleSignals, sample_tokens, sampled_drift
from services.learner.prompt_rows import Rows, layout
from services.learner.sequences import Sequence

LN = math.log


class FixedPolicy:
    """Stands in for MultiAdapterPolicy in this test only: every position's next-token
    logits are fixed, [ln 3, 0] with the adapter (p = 3/4, 1/4) and [0, 0] without it."""

    pad_id = 0
    varlen = False

    def activate(self, policy: str) -> None:
        pass

    def row_layout(self, seqs: list[Sequence], row_tokens: int) -> Rows:
        return layout(seqs, self.pad_id, row_tokens, torch.float32)

    def row_features(self, rows: Rows, base: bool = False) -> torch.Tensor:
        n = len(rows.rows)
        return torch.tensor([0.0, 0.0] if base else [LN(3.0), 0.0]).expand(n, 2).clone()

    def row_features_with_base(self, rows: Rows) -> tuple[torch.Tensor, torch.Tensor]:
        return self.row_features(rows), self.row_features(rows, base=True)

    def head(self, features: torch.Tensor) -> torch.Tensor:
        return features


def seq(role: str, completion: list[int], n_prompt: int = 2) -> Sequence:
    return Sequence("shared", role, [1] * n_prompt + completion, n_prompt, 1.0,
                    [0.0] * len(completion))


def test_perplexity_from_old_logprobs_by_hand() -> None:
    sig = RoleSignals()
    sig.add_old(
        [seq("generator", [0, 1]), seq("aggregator", [0])],
        [torch.tensor([LN(0.5), LN(0.25)]), torch.tensor([LN(0.1)])],
    )
    m = sig.metrics()
    # generator: mean NLL (ln 2 + ln 4) / 2 = 1.5 ln 2 -> 2^1.5; aggregator: 1 / 0.1
    assert m["role/generator/training_ppl"] == pytest.approx(2**1.5)
    assert m["role/aggregator/training_ppl"] == pytest.approx(10.0)
    # the gap to the sampling log-probs (0 here): mean |old - sampled|
    assert m["role/generator/logprob_gap"] == pytest.approx(1.5 * LN(2))


def test_chi2_token_and_training_ppl_are_verls_by_hand() -> None:
    """ρ = π_learner / π_sampler per token; χ²_token = mean(ρ²) - 1 over every token of the
    role; training_ppl = mean over sequences of exp(the sequence's mean NLL)."""
    sig = RoleSignals()
    gen = [
        Sequence("a", "generator", [1, 1, 0, 0], 2, 1.0, [LN(0.25), LN(0.5)]),
        Sequence("a", "generator", [1, 1, 0], 2, 1.0, [LN(0.5)]),
    ]
    # learner: 0.5 and 0.5 on the first sequence (ρ = 2 and 1), 0.25 on the second (ρ = 0.5)
    sig.add_old(gen, [torch.tensor([LN(0.5), LN(0.5)]), torch.tensor([LN(0.25)])])
    sig.add_old([Sequence("b", "aggregator", [1, 0], 1, 1.0, [LN(0.1)])],
                [torch.tensor([LN(0.1)])])
    m = sig.metrics()
    assert m["role/generator/chi2_token"] == pytest.approx((4 + 1 + 0.25) / 3 - 1)
    assert m["role/generator/training_ppl"] == pytest.approx((2.0 + 4.0) / 2)
    assert m["policy/a/chi2_token"] == m["role/generator/chi2_token"]
    assert m["policy/a/training_ppl"] == m["role/generator/training_ppl"]
    assert m["role/aggregator/chi2_token"] == pytest.approx(0.0, abs=1e-12)
    assert m["policy/b/training_ppl"] == pytest.approx(10.0)
    # a token the sampler found near-impossible: log ρ clamped at 20 (verl's bound)
    far = RoleSignals()
    far.add_old([Sequence("a", "generator", [1, 0], 1, 1.0, [-100.0])], [torch.tensor([0.0])])
    assert far.metrics()["role/generator/chi2_token"] == pytest.approx(math.exp(40) - 1)


def test_sampler_learner_gap_per_adapter_by_hand() -> None:
    # the sampler q drew token 0 (q = 3/4) three times and token 1 (q = 1/4) once, where
    # the learner's π_old gives (1/2, 1/2): exactly q's proportions, so the mean of
    # exp(d) - 1 - d is KL(q || π_old) itself
    sig = RoleSignals()
    q = [LN(0.75)] * 3 + [LN(0.25)]
    sig.add_old([Sequence("a", "generator", [1, 1, 0, 0, 0, 1], 2, 1.0, q)],
                [torch.tensor([LN(0.5)] * 4)])
    # adapter b: inference and learner agree to the bit
    sig.add_old([Sequence("b", "aggregator", [1, 0], 1, 1.0, [LN(0.3)])],
                [torch.tensor([LN(0.3)])])
    m = sig.metrics()
    kl = 0.75 * LN(0.75 / 0.5) + 0.25 * LN(0.25 / 0.5)
    assert m["policy/a/logprob_kl"] == pytest.approx(kl)
    assert m["policy/a/logprob_gap"] == pytest.approx((3 * LN(1.5) + LN(2)) / 4)
    assert m["policy/b/logprob_gap"] == 0.0
    assert m["policy/b/logprob_kl"] == 0.0
    assert m["role/generator/logprob_gap"] == m["policy/a/logprob_gap"]


def test_chi2_and_kl_to_base_by_hand() -> None:
    # targets: token 0 (p = 3/4) and token 1 (p = 1/4); π_old gave both probability 1/2
    seqs = [seq("generator", [0, 1]), seq("aggregator", [1])]
    old = [torch.tensor([LN(0.5), LN(0.5)]), torch.tensor([LN(0.5)])]
    sig = RoleSignals()
    picked = {0: [0, 1], 1: [0]}
    sampled_drift(FixedPolicy(), seqs, old, picked, 1.0, 8, sig)  # type: ignore[arg-type]
    m = sig.metrics()
    # ratios 1.5 and 0.5 -> (0.5² + 0.5²) / 2 = 0.25; aggregator: ratio 0.5 -> 0.25
    assert m["role/generator/update_chi2"] == pytest.approx(0.25)
    assert m["role/aggregator/update_chi2"] == pytest.approx(0.25)
    # per adapter: both roles on `shared`, (0.25 + 0.25 + 0.25) / 3 tokens
    assert m["policy/shared/update_chi2"] == pytest.approx(0.25)
    kl = 0.75 * LN(0.75 / 0.5) + 0.25 * LN(0.25 / 0.5)  # KL((3/4, 1/4) || (1/2, 1/2))
    assert m["role/generator/kl_base"] == pytest.approx(kl)
    assert m["role/aggregator/kl_base"] == pytest.approx(kl)


def test_token_sample_is_uniform_over_tokens_not_sequences() -> None:
    # one role, a 1-token and a 3-token sequence: each token is drawn 1/4 of the time
    seqs = [seq("generator", [0]), seq("generator", [0, 0, 0])]
    counts: Counter[tuple[int, int]] = Counter()
    rng = random.Random(0)
    for _ in range(4000):
        for i, pos in sample_tokens(seqs, 1, rng).items():
            counts.update((i, j) for j in pos)
    assert set(counts) == {(0, 0), (1, 0), (1, 1), (1, 2)}
    for n in counts.values():
        assert n == pytest.approx(1000, abs=120)


def test_every_role_gets_its_own_sample() -> None:
    seqs = [seq("generator", [0] * 50), seq("aggregator", [0, 0])]
    picked = sample_tokens(seqs, 8, random.Random(1))
    assert len(picked[0]) == 8 and sorted(picked[1]) == [0, 1]
    assert len(set(picked[0])) == 8 and all(0 <= j < 50 for j in picked[0])


def test_grad_share_sums_to_one() -> None:
    sig = RoleSignals()
    sig.add_grad("generator", 3.0, "shared")
    sig.add_grad("aggregator", 1.0, "shared")
    m = sig.metrics()
    assert (m["role/generator/grad_share"], m["role/aggregator/grad_share"]) == (0.75, 0.25)


def test_a_roles_grad_norm_is_its_mean_over_its_adapters_optimizer_steps() -> None:
    sig = RoleSignals()
    sig.optimizer_steps.update(shared=4, aggregator=1)
    for norm in (1.0, 2.0, 3.0):  # the generator in 3 of the shared adapter's 4 mini-batches
        sig.add_grad("generator", norm, "shared")
    sig.add_grad("worker", 2.0, "shared")
    sig.add_grad("aggregator", 0.5, "aggregator")
    m = sig.metrics()
    assert m["role/generator/grad_norm"] == 1.5  # (1 + 2 + 3 + 0) / 4
    assert m["role/worker/grad_norm"] == 0.5 and m["role/aggregator/grad_norm"] == 0.5


@pytest.mark.parametrize("mode", ["shared", "isolated"])
def test_every_role_signal_is_logged_under_ip_and_sp(model_dir: Path, mode: str) -> None:
    from tests.support.batches import new_policy, spec, step, voting_batch

    s = spec(mini_batch_size=4)
    policy = new_policy(model_dir, mode, s)
    result = step(policy, voting_batch(), mode, s)
    m = result.metrics
    for role in ("generator", "aggregator"):
        for name in ("entropy", "training_ppl", "chi2_token", "clip_fraction", "update_chi2",
                     "kl_base", "grad_norm", "grad_share"):
            assert math.isfinite(m[f"role/{role}/{name}"]), (role, name)
        assert m[f"role/{role}/grad_norm"] > 0
        assert m[f"role/{role}/update_chi2"] > 0 and m[f"role/{role}/kl_base"] > 0
    assert m["role/generator/grad_share"] + m["role/aggregator/grad_share"] == pytest.approx(1)
    steps: dict[str, list[float]] = {}
    for mb in result.mini_batches:
        steps.setdefault(mb.policy, []).append(mb.grad_norm)
    assert max(map(len, steps.values())) > 1  # a mean over several optimizer steps
    if mode == "isolated":
        # one role per adapter: the role's grad norm is its adapter's, one definition
        for role in ("generator", "aggregator"):
            mean = sum(steps[role]) / len(steps[role])
            assert m[f"role/{role}/grad_norm"] == pytest.approx(mean, rel=1e-4)
            assert m[f"policy/{role}/grad_norm"] == pytest.approx(mean, rel=1e-12)
    else:
        # under SP the roles' parts add up to each mini-batch's gradient
        total = m["role/generator/grad_norm"] + m["role/aggregator/grad_norm"]
        assert total >= m["policy/shared/grad_norm"] * (1 - 1e-5)
    assert 0 < m["time/diagnostics_s"]
    assert diagnostics.SAMPLE_TOKENS_PER_ROLE > 0


@pytest.mark.parametrize("mode", ["shared", "isolated"])
def test_signals_measured_after_the_push_are_the_steps_own(model_dir: Path, mode: str) -> None:
    """`drift_later` leaves the signals to `measure_drift`: the same tokens are sampled and
    every metric is the one the step would have logged itself; none is logged before."""
    from services.learner.update import grpo_step, measure_drift
    from tests.support.batches import ROLES, new_policy, spec, voting_batch

    s = spec(mini_batch_size=4)
    at_once, later = new_policy(model_dir, mode, s), new_policy(model_dir, mode, s)
    batch = voting_batch()
    groups = [r.problem_id for r in batch]
    expected = grpo_step(at_once, batch, groups, ROLES[mode], s).metrics
    first = grpo_step(later, batch, groups, ROLES[mode], s, drift_later=True).metrics
    assert not [k for k in first if "kl_base" in k or "chi2" in k or k == "time/diagnostics_s"]
    signals = measure_drift(later)
    assert measure_drift(later) == {}  # measured once
    got = {**first, **signals}
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        if k != "time/diagnostics_s":
            assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    assert signals["role/generator/kl_base"] > 0 and signals["time/diagnostics_s"] > 0


def test_picked_sequences_are_cut_after_their_last_sampled_token() -> None:
    seqs = [seq("generator", [5, 6, 7, 8]), seq("generator", [5, 6]), seq("aggregator", [9, 9])]
    short = diagnostics.upto_last_picked(seqs, {0: [2, 0], 2: [1]})
    assert short[0].tokens == [1, 1, 5, 6, 7] and short[0].n_prompt == 2
    assert short[1] is seqs[1] and short[2].tokens == seqs[2].tokens
    assert seqs[0].tokens == [1, 1, 5, 6, 7, 8]


def test_drift_on_cut_sequences_matches_full_forwards(model_dir: Path) -> None:
    """On the real model, shared prompt rows and all: χ² and KL at the sampled tokens from
    the cut sequences, adapter and base in one forward (lora.lora_on_rows), equal those of
    each whole sequence forwarded on its own, the base through PEFT's disable_adapter."""
    from tests.support.batches import new_policy, spec

    policy = new_policy(model_dir, "shared", spec())
    torch.manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters("shared"):
            p.normal_(0, 0.3)  # B starts at zero: without this the adapter is the base model
    prompts = [[3, 4, 5, 6], [7, 8, 9]]
    gen = torch.Generator().manual_seed(1)
    seqs = [
        Sequence("shared", role, prompt + torch.randint(10, 20, (n,), generator=gen).tolist(),
                 len(prompt), 1.0, [0.0] * n)
        for prompt, role, n in [(prompts[0], "generator", 9), (prompts[0], "generator", 7),
                                (prompts[1], "aggregator", 8), (prompts[0], "generator", 5)]
    ]
    old = [-torch.rand(len(s.tokens) - s.n_prompt, generator=gen) for s in seqs]
    picked = {0: [1, 4], 1: [6], 2: [0], 3: [2, 3]}
    forwarded: list[int] = []
    rows_forwarded: list[int] = []
    features, with_base = policy.features, policy.row_features_with_base

    def counting(input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        rows_forwarded.append(input_ids.shape[0])
        return features(input_ids, *args, **kwargs)

    def cut(rows: Rows) -> tuple[torch.Tensor, torch.Tensor]:
        forwarded.extend(rows.lengths)
        return with_base(rows)

    policy.features = counting  # type: ignore[method-assign]
    policy.row_features_with_base = cut  # type: ignore[method-assign]
    sig = RoleSignals()
    sampled_drift(policy, seqs, old, picked, 1.0, 8, sig, 1024, 64)
    m = sig.metrics()
    assert sorted(forwarded) == sorted([5, 7, 1, 4])  # cut after the last sampled token
    assert rows_forwarded == [4]  # one forward: the two prompts' rows and their copy

    want: dict[str, list[float]] = {"generator": [0.0, 0.0, 0], "aggregator": [0.0, 0.0, 0]}
    with torch.no_grad():
        for i, positions in picked.items():
            s = seqs[i]
            ids = torch.tensor([s.tokens])
            logp = torch.log_softmax(policy.head(policy.features(ids, torch.ones_like(ids))[0]), -1)
            with policy.model.disable_adapter():
                base = policy.head(policy.features(ids, torch.ones_like(ids))[0])
            logq = torch.log_softmax(base, -1)
            for j in positions:
                at, target = s.n_prompt - 1 + j, s.tokens[s.n_prompt + j]
                ratio = math.exp(float(logp[at, target] - old[i][j]))
                kl = float((logp[at].exp() * (logp[at] - logq[at])).sum())
                w = want[s.role]
                w[0] += (ratio - 1) ** 2
                w[1] += kl
                w[2] += 1
    for role, (chi2, kl, n) in want.items():
        assert m[f"role/{role}/update_chi2"] == pytest.approx(chi2 / n, rel=1e-4)
        assert m[f"role/{role}/kl_base"] == pytest.approx(kl / n, rel=1e-4)
        assert kl > 0
