"""Per-role training signals the paper reads (§5, §A.3-A.4), every step, under IP and SP.

`role/<role>/...` in metrics.jsonl:
- `chi2_token`: **the paper's token-level χ²**, verl's rollout-correction χ²: mean(ρ²) - 1
  over every completion token of the role this step, ρ = π_learner / π_sampler, π_learner
  being the learner's recompute at the step's start (π_old) and π_sampler the log-prob
  inference reported when it sampled the token (log ρ clamped to ±20, as verl does);
- `training_ppl`: **the paper's training perplexity**, verl's: the mean over the role's
  sequences of exp(mean negative log-likelihood of the sequence's tokens under π_old);
- `update_chi2`: marl's own: mean of (π/π_old - 1)² after the step's updates, over a
  uniform random sample of the role's tokens: how far the policy moved during the step.
  On a float32 CPU run learner and sampler agree (ρ ≈ 1, chi2_token ≈ 0) and this is the
  χ² that moves;
- `entropy`: mean token entropy of the role's turns in the step's first-epoch forwards;
- `clip_fraction`: share of the role's token updates the PPO clip cut off (both bounds);
- `kl_base`: KL(π || π_base) of the full next-token distributions at the sampled tokens,
  π_base being the base model with every adapter disabled;
- `grad_norm`: the norm of the gradient the role's part of a mini-batch's loss puts on its
  adapter, averaged over the step's optimizer steps of that adapter (a mini-batch without
  the role's turns counts 0): each one a single optimizer step's norm, averaged as verl
  averages `actor/grad_norm` over its mini-batches, and as `policy/<adapter>/grad_norm` is.
  One definition under IP and SP: with one role on an adapter the two are equal; under SP
  each role is back-propagated apart, so the roles' parts sum to each mini-batch's
  gradient;
- `grad_share`: the role's grad_norm over the sum of every role's grad_norm this step: who
  drives the update, the `sp_role_capture` evidence under SP;
- `logprob_gap`: mean |log π_old - log q| over the role's tokens, q being the log-prob
  inference reported when it sampled the token.

`policy/<adapter>/...`: `chi2_token`, `training_ppl` and `update_chi2` over every token
(sequence) the adapter served (the paper's single shared-policy row under SP), and the
sampler/learner divergence:
- `logprob_gap`: mean |log π_old - log q| over every token the adapter served;
- `logprob_kl`: an estimate of KL(q || π_old) from those tokens, which q sampled:
  the mean of exp(d) - 1 - d with d = log π_old - log q (unbiased and never negative).
With the learner training the version that served the step (the synchronous loop), both
measure the engines' disagreement alone: ~0 between the transformers engine and the learner,
small for a lower-precision engine, and growing with every step when inference silently
serves something else (a failed adapter sync). The `sampler_mismatch` alarm reads the gap.
chi2_token, training_ppl and the gap come from π_old, which the update computes anyway: no
extra forward. update_chi2 and kl_base cost one forward over at most
SAMPLE_TOKENS_PER_ROLE sequences per role, each cut after its last sampled token, and their
copy with the adapter scaled to 0 (`MultiAdapterPolicy.row_features_with_base`).

Off-policy steps (`train.max_staleness` >= 1) also record the importance weights π_old/μ
(`train/importance_weight_mean`, `train/importance_truncated_fraction`).

The step feeds all of it through one observer, `StepDiagnostics`, which times itself
(`time/diagnostics_s`); records.py names what it sums.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch

from marl.spec.run import GRPOSpec
from services.learner import fsdp, records
from services.learner.grpo import LossStats, at_least_float32
from services.learner.policy import MultiAdapterPolicy
from services.learner.prompt_rows import pack_rows
from services.learner.sequences import Sequence

SAMPLE_TOKENS_PER_ROLE = 32


LOG_RATIO_BOUND = 20.0
"""|log ρ| is clamped here before ρ² (verl's SAFETY_BOUND): one token the sampler found
near-impossible must not overflow the step's χ²."""


@dataclass
class OldSums:
    """Sums over π_old's log-probs of the tokens (and sequences) a role or adapter served."""

    tokens: float = 0.0
    sequences: float = 0.0
    ppl: float = 0.0
    chi2_token: float = 0.0
    logprob_gap: float = 0.0
    kl: float = 0.0
    update_chi2: float = 0.0
    sampled: float = 0.0

    def add(self, olds: list[torch.Tensor], sampled: list[list[float]]) -> None:
        """One role's (or adapter's) sequences: π_old's log-probs and the sampler's."""
        lengths = [len(o) for o in olds]
        old = torch.cat(olds)
        q = torch.tensor(
            [lp for s, n in zip(sampled, lengths, strict=True) for lp in s[:n]],
            dtype=old.dtype,
            device=old.device,
        )
        d = old - q
        seg = torch.repeat_interleave(
            torch.arange(len(lengths), device=old.device),
            torch.tensor(lengths, device=old.device),
        )
        n = torch.tensor(lengths, dtype=old.dtype, device=old.device)
        nll = torch.zeros(len(lengths), dtype=old.dtype, device=old.device).index_add_(0, seg, -old)
        ppl = torch.exp(nll[n > 0] / n[n > 0])
        rho2 = torch.exp(2 * d.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        sums = torch.stack(
            [ppl.sum(), (rho2 - 1).sum(), d.abs().sum(), (torch.expm1(d) - d).sum()]
        ).tolist()
        self.tokens += len(old)
        self.sequences += len(ppl)
        self.ppl += sums[0]
        self.chi2_token += sums[1]
        self.logprob_gap += sums[2]
        self.kl += sums[3]


@dataclass
class RoleSums:
    old: OldSums = field(default_factory=OldSums)
    entropy: float = 0.0
    updated_tokens: float = 0.0
    clipped: float = 0.0
    kl_base: float = 0.0
    grad_norm: float = 0.0
    """Summed over the step's optimizer steps; `RoleSignals.optimizer_steps` divides it."""
    grad_policy: str | None = None
    """The adapter the role's gradient went to."""


@dataclass
class RoleSignals:
    """Accumulates one step's per-role sums; `metrics()` turns them into means."""

    roles: dict[str, RoleSums] = field(default_factory=lambda: defaultdict(RoleSums))
    policies: dict[str, OldSums] = field(default_factory=lambda: defaultdict(OldSums))
    optimizer_steps: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Adapter -> its optimizer steps this step (the mini-batches a role's mean is over)."""

    def add_old(self, seqs: list[Sequence], olds: list[torch.Tensor]) -> None:
        """π_old's log-probs of each sequence's completion against what inference reported
        when it sampled: χ², training perplexity and the gap, per role and per adapter. A
        few tensor operations per role and adapter, not per sequence (a step holds hundreds
        of short ones)."""
        groups: dict[tuple[str, str], list[int]] = defaultdict(list)
        for i, s in enumerate(seqs):
            groups[(s.role, s.policy)].append(i)
        for (role, policy), idx in groups.items():
            olds_of = [olds[i] for i in idx]
            sampled = [seqs[i].sample_logprobs for i in idx]
            self.roles[role].old.add(olds_of, sampled)
            self.policies[policy].add(olds_of, sampled)

    def add_update(self, role: str, tokens: int, clipped: int, entropy: float | None) -> None:
        r = self.roles[role]
        r.updated_tokens += tokens
        r.clipped += clipped
        if entropy is not None:
            r.entropy += entropy

    def add_grad(self, role: str, norm: float, policy: str) -> None:
        """The norm of the role's part of one optimizer step's gradient on `policy`."""
        r = self.roles[role]
        r.grad_norm += norm
        r.grad_policy = policy

    def grad_norm(self, role: str) -> float:
        """The role's part of its adapter's gradient, averaged over the adapter's optimizer
        steps this step."""
        r = self.roles[role]
        steps = self.optimizer_steps.get(r.grad_policy or "", 0)
        return r.grad_norm / steps if steps else r.grad_norm

    def metrics(self) -> dict[str, float]:
        return records.signal_metrics(self)


def sample_tokens(seqs: list[Sequence], per_role: int, rng: random.Random) -> dict[int, list[int]]:
    """Up to `per_role` completion tokens of each role, drawn uniformly without replacement
    from all of that role's tokens this step: sequence index -> completion positions."""
    by_role: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for i, s in enumerate(seqs):
        for j in range(len(s.tokens) - s.n_prompt):
            by_role[s.role].append((i, j))
    picked: dict[int, list[int]] = defaultdict(list)
    for role in sorted(by_role):
        pool = by_role[role]
        for i, j in rng.sample(pool, min(per_role, len(pool))):
            picked[i].append(j)
    return dict(picked)


def upto_last_picked(seqs: list[Sequence], picked: dict[int, list[int]]) -> list[Sequence]:
    """`seqs` with each picked one cut after its last sampled completion token: a causal
    model's next-token distributions at the sampled positions do not depend on what
    follows, so the drift forwards skip it (about half the positions of a long completion
    with one token sampled from it)."""
    short = list(seqs)
    for i, positions in picked.items():
        s = seqs[i]
        short[i] = replace(s, tokens=s.tokens[: s.n_prompt + max(positions) + 1])
    return short


@torch.no_grad()
def sampled_drift(
    policy: MultiAdapterPolicy,
    seqs: list[Sequence],
    old: list[torch.Tensor],
    picked: dict[int, list[int]],
    temperature: float,
    micro: int,
    signals: RoleSignals,
    max_tokens: int | None = None,
    row_tokens: int = 0,
) -> None:
    """update_chi2 (against π_old) and KL to the base model at the sampled tokens, after
    the update.

    Micro-batches as the update packs them (`micro` sequences, `max_tokens` padded
    positions, prompts shared up to `row_tokens` a row); full next-token distributions
    only at the sampled positions."""
    by_policy: dict[str, list[int]] = defaultdict(list)
    for i in sorted(picked):
        by_policy[seqs[i].policy].append(i)
    short = upto_last_picked(seqs, picked)
    t = temperature if temperature > 0 else 1.0
    for p, idx in by_policy.items():
        policy.activate(p)
        budget = max_tokens or 2**62
        for chunk in pack_rows(short, idx, micro, budget, row_tokens, varlen=policy.varlen):
            rows = policy.row_layout([short[i] for i in chunk], row_tokens)
            starts = [0, *itertools.accumulate(rows.lengths)]
            sel = torch.cat(
                [torch.tensor(picked[i], dtype=torch.long) + starts[k] for k, i in enumerate(chunk)]
            )
            feats, base = policy.row_features_with_base(rows)
            feats, base = feats[sel], base[sel]
            logp_all = torch.log_softmax(at_least_float32(policy.head(feats)) / t, -1)
            logq_all = torch.log_softmax(at_least_float32(policy.head(base)) / t, -1)
            targets = rows.targets[sel].to(logp_all.device)
            new_all = logp_all.gather(-1, targets[:, None]).squeeze(-1)
            sizes = [len(picked[i]) for i in chunk]
            parts = zip(
                new_all.split(sizes), logp_all.split(sizes), logq_all.split(sizes), strict=True
            )
            for i, (new, logp, logq) in zip(chunk, parts, strict=True):
                s = seqs[i]
                pos = torch.tensor(picked[i], dtype=torch.long, device=new.device)
                ratio = torch.exp(new - old[i][pos])
                kl = (logp.exp() * (logp - logq)).sum(-1)
                moved = float(((ratio - 1) ** 2).sum())
                r = signals.roles[s.role]
                r.kl_base += float(kl.sum())
                for sums in (r.old, signals.policies[s.policy]):
                    sums.update_chi2 += moved
                    sums.sampled += len(pos)


@dataclass
class ImportanceStats:
    """The importance weights π_old/μ of an off-policy step's tokens (update.py)."""

    tokens: int = 0
    total: float = 0.0
    truncated: int = 0

    def add(self, weights: torch.Tensor, cap: float) -> None:
        self.tokens += len(weights)
        self.total += float(weights.sum())
        self.truncated += int((weights >= cap).sum())

    def metrics(self) -> dict[str, float]:
        return records.importance_metrics(self)


def full_grads(policy: MultiAdapterPolicy, p: str) -> list[torch.Tensor]:
    """The adapter's accumulated gradient, whole (gathered from every rank's shard)."""
    return [
        fsdp.full(x.grad.detach()).clone()
        if x.grad is not None
        else torch.zeros((), device=policy.device)
        for x in policy.parameters(p)
    ]


class StepDiagnostics:
    """The observer a GRPO step calls as it runs: it sums the per-role signals (and, for an
    off-policy step, the importance weights) and times what it does itself."""

    def __init__(self, off_policy: bool):
        self.signals = RoleSignals()
        self.importance = ImportanceStats() if off_policy else None
        self.seconds = 0.0
        """Time spent here: `time/diagnostics_s`."""
        self._before: list[torch.Tensor] | None = None

    @contextmanager
    def _timed(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - t0

    def mini_batch_starts(self, p: str) -> None:
        """Adapter `p`'s next mini-batch, one optimizer step, begins."""
        self.signals.optimizer_steps[p] += 1

    def role_starts(self, policy: MultiAdapterPolicy, p: str) -> None:
        """A role's micro-batches of adapter `p`'s mini-batch are next: the gradient so far
        is noted, to read the role's part of it apart."""
        with self._timed():
            self._before = full_grads(policy, p)

    def role_ends(self, policy: MultiAdapterPolicy, p: str, role: str) -> None:
        """The role's micro-batches are back-propagated: the norm of its part (`grad_norm`)."""
        if self._before is None:
            return
        with self._timed():
            after = full_grads(policy, p)
            # a 0-d `before` stands for a gradient not there yet: the role's part is all of it
            part = [a if z.ndim == 0 else a - z for a, z in zip(after, self._before, strict=True)]
            norm = float(torch.nn.utils.get_total_norm(part, foreach=True))
            self.signals.add_grad(role, norm, p)
            self._before = None

    def weighted(self, weights: torch.Tensor, cap: float) -> None:
        """A real sequence's importance weights (off-policy steps)."""
        if self.importance is not None:
            self.importance.add(weights, cap)

    def updated(self, role: str, stats: LossStats, entropy: float | None) -> None:
        """One micro-batch's loss stats, from any rank; `entropy`: its tokens' summed
        entropy in the first epoch."""
        self.signals.add_update(role, stats.tokens, stats.clipped_low + stats.clipped_high, entropy)

    def step_ends(
        self,
        policy: MultiAdapterPolicy,
        seqs: list[Sequence],
        old: list[torch.Tensor | None],
        rng: random.Random,
        temperature: float,
        g: GRPOSpec,
    ) -> None:
        """After the step's last optimizer step: the signals of π_old, and the drift
        of a sample of tokens drawn with `rng`; every rank's importance weights."""
        with self._timed():
            final_old = [o if o is not None else torch.zeros(0) for o in old]
            self.signals.add_old(seqs, final_old)
            picked = sample_tokens(seqs, SAMPLE_TOKENS_PER_ROLE, rng)
            sampled_drift(
                policy, seqs, final_old, picked,
                temperature=temperature,
                micro=g.micro_batch_sequences,
                signals=self.signals,
                max_tokens=g.max_tokens_per_micro_batch,
                row_tokens=g.row_tokens,
            )
        if self.importance is not None:
            for part in fsdp.gather(self.importance)[1:]:
                self.importance.tokens += part.tokens
                self.importance.total += part.total
                self.importance.truncated += part.truncated

    def metrics(self) -> dict[str, float]:
        """The per-role signals, the time spent here (`time/diagnostics_s`) and, off-policy,
        the importance weights; once `step_ends` has run."""
        m = {**self.signals.metrics(), "time/diagnostics_s": self.seconds}
        if self.importance is not None:
            m.update(self.importance.metrics())
        return m
