"""Per-role training signals the paper reads (§5, §A.3-A.4), every step, under IP and SP.

`role/<role>/...` in metrics.jsonl:
- `entropy`: mean token entropy of the role's turns in the step's first-epoch forwards;
- `perplexity`: exp of the mean negative log-likelihood of the role's tokens under π_old;
- `clip_fraction`: share of the role's token updates the PPO clip cut off (both bounds);
- `chi2`: mean of (π/π_old - 1)² after the step's updates, over a uniform random sample of
  the role's tokens;
- `kl_base`: KL(π || π_base) of the full next-token distributions at those sampled tokens,
  π_base being the base model with every adapter disabled;
- `grad_norm`: norm of the gradient the role's part of its adapter's first mini-batch loss
  puts on that adapter (under SP each role is back-propagated apart, so the roles' parts
  sum to the mini-batch's gradient);
- `grad_share`: the role's grad_norm over the sum of every role's grad_norm this step: who
  drives the update, the `sp_role_capture` evidence under SP;
- `logprob_gap`: mean |log π_old - log q| over the role's tokens, q being the log-prob
  inference reported when it sampled the token.

`policy/<adapter>/...`, the same sampler/learner divergence per adapter:
- `logprob_gap`: mean |log π_old - log q| over every token the adapter served;
- `logprob_kl`: an estimate of KL(q || π_old) from those tokens, which q sampled:
  the mean of exp(d) - 1 - d with d = log π_old - log q (unbiased and never negative).
With the learner training the version that served the step (the synchronous loop), both
measure the engines' disagreement alone: ~0 between the transformers engine and the learner,
small for a lower-precision engine, and growing with every step when inference silently
serves something else (a failed adapter sync). The `sampler_mismatch` alarm reads the gap.
The sample costs two forwards over at most SAMPLE_TOKENS_PER_ROLE sequences per role, each
cut after its last sampled token (`bench/drift.py`).
"""

from __future__ import annotations

import itertools
import math
import random
from collections import defaultdict
from dataclasses import dataclass, field, replace

import torch

from services.learner.policy import MultiAdapterPolicy
from services.learner.prompt_rows import pack_rows
from services.learner.sequences import Sequence

SAMPLE_TOKENS_PER_ROLE = 32


@dataclass
class RoleSums:
    tokens: float = 0.0
    entropy: float = 0.0
    nll_old: float = 0.0
    logprob_gap: float = 0.0
    updated_tokens: float = 0.0
    clipped: float = 0.0
    chi2: float = 0.0
    kl_base: float = 0.0
    sampled: float = 0.0
    grad_norm: float = 0.0


@dataclass
class GapSums:
    tokens: float = 0.0
    gap: float = 0.0
    kl: float = 0.0


@dataclass
class RoleSignals:
    """Accumulates one step's per-role sums; `metrics()` turns them into means."""

    roles: dict[str, RoleSums] = field(default_factory=lambda: defaultdict(RoleSums))
    policies: dict[str, GapSums] = field(default_factory=lambda: defaultdict(GapSums))

    def add_old(self, seqs: list[Sequence], olds: list[torch.Tensor]) -> None:
        """π_old's log-probs of each sequence's completion: perplexity and the gap to what
        inference reported when it sampled. A few tensor operations per role and adapter,
        not per sequence (a step holds hundreds of short ones)."""
        groups: dict[tuple[str, str], list[int]] = defaultdict(list)
        for i, s in enumerate(seqs):
            groups[(s.role, s.policy)].append(i)
        for (role, policy), idx in groups.items():
            old = torch.cat([olds[i] for i in idx])
            sampled = [lp for i in idx for lp in seqs[i].sample_logprobs[: len(olds[i])]]
            d = old - torch.tensor(sampled, dtype=old.dtype, device=old.device)
            sums = torch.stack([old.sum(), d.abs().sum(), (torch.expm1(d) - d).sum()]).tolist()
            r = self.roles[role]
            r.tokens += len(old)
            r.nll_old -= sums[0]
            r.logprob_gap += sums[1]
            p = self.policies[policy]
            p.tokens += len(old)
            p.gap += sums[1]
            p.kl += sums[2]

    def add_update(self, role: str, tokens: int, clipped: int, entropy: float | None) -> None:
        r = self.roles[role]
        r.updated_tokens += tokens
        r.clipped += clipped
        if entropy is not None:
            r.entropy += entropy

    def add_grad(self, role: str, norm: float) -> None:
        self.roles[role].grad_norm += norm

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        total_grad = sum(r.grad_norm for r in self.roles.values())
        for role, r in sorted(self.roles.items()):
            pre = f"role/{role}/"
            out[pre + "entropy"] = r.entropy / max(r.tokens, 1)
            out[pre + "perplexity"] = math.exp(r.nll_old / max(r.tokens, 1))
            out[pre + "logprob_gap"] = r.logprob_gap / max(r.tokens, 1)
            out[pre + "clip_fraction"] = r.clipped / max(r.updated_tokens, 1)
            out[pre + "grad_norm"] = r.grad_norm
            out[pre + "grad_share"] = r.grad_norm / total_grad if total_grad > 0 else 0.0
            if r.sampled:
                out[pre + "chi2"] = r.chi2 / r.sampled
                out[pre + "kl_base"] = r.kl_base / r.sampled
        for policy, p in sorted(self.policies.items()):
            out[f"policy/{policy}/logprob_gap"] = p.gap / max(p.tokens, 1)
            out[f"policy/{policy}/logprob_kl"] = p.kl / max(p.tokens, 1)
        return out


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
    """χ² against π_old and KL to the base model at the sampled tokens, after the update.

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
        for chunk in pack_rows(short, idx, micro, max_tokens or 2**62, row_tokens):
            rows = policy.row_layout([short[i] for i in chunk], row_tokens)
            starts = [0, *itertools.accumulate(rows.lengths)]
            sel = torch.cat(
                [torch.tensor(picked[i], dtype=torch.long) + starts[k] for k, i in enumerate(chunk)]
            )
            feats = policy.row_features(rows)[sel]
            base = policy.row_features(rows, base=True)[sel]
            logp_all = torch.log_softmax(policy.head(feats).float() / t, -1)
            logq_all = torch.log_softmax(policy.head(base).float() / t, -1)
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
                r = signals.roles[s.role]
                r.chi2 += float(((ratio - 1) ** 2).sum())
                r.kl_base += float(kl.sum())
                r.sampled += len(pos)
