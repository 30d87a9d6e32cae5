"""One GRPO step over a step's rollouts, with mini-batches counted as the paper counts them.

Failed episodes leave their groups; advantages are group-relative over the rest.
Each adapter's role-turn sequences are shuffled into mini-batches of
`grpo.mini_batch_size` problems x `grpo.group_size` sequences (verl's count), one
AdamW step each, so an adapter serving more turns takes more steps (Voting-IP's
generator 3, its aggregator 1 at the paper's defaults). π_old is
the policy before the step's first update: the first mini-batch's own forward
(detached) gives it for its sequences, one no-grad forward before that update
gives it for the others; every later mini-batch is off-policy, so ratios,
clipping and clip fractions are real. The per-role signals live in
diagnostics.py; this module only computes the update and feeds them.

Off-policy steps (`train.max_staleness` >= 1) were sampled by an older version μ of
each adapter. The loss is AReaL's decoupled PPO objective: the trust region is around
π_old, the learner's recompute with the version it trains now (the proximal policy),
and each token is reweighted by π_old/μ, which corrects for the tokens having been drawn
from μ. The weight is truncated at `grpo.importance_cap` (truncated importance sampling)
so one token μ found unlikely cannot dominate a mini-batch. π_old rather than μ anchors
the clip because μ may be several updates old: clipping around it would freeze every
token the learner has already moved past. At max_staleness 0, μ and π_old are the same
version (they differ by engine rounding alone, `policy/<adapter>/logprob_gap`), and the
loss is left exactly the on-policy one.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from marl.config import RunSpec
from marl.rollout import Rollout
from services.learner import diagnostics, fsdp
from services.learner.grpo import (
    LossStats,
    clipped_loss,
    good_rollouts,
    group_advantages,
    token_weights,
)
from services.learner.policy import MultiAdapterPolicy
from services.learner.prompt_rows import pack_rows
from services.learner.sequences import Sequence, build_sequences


@dataclass
class MiniBatchStats:
    policy: str
    index: int
    """Optimizer step of this adapter within the step (0 = on-policy)."""
    sequences: int
    loss: float
    grad_norm: float
    tokens: int = 0
    clipped_low: int = 0
    clipped_high: int = 0
    ratio_min: float = float("inf")
    ratio_max: float = float("-inf")


@dataclass
class StepResult:
    metrics: dict[str, float]
    mini_batches: list[MiniBatchStats] = field(default_factory=list)


def plan_mini_batches(
    seqs: list[Sequence], size: int, epochs: int, rng: random.Random
) -> dict[str, list[list[int]]]:
    """Adapter -> its mini-batches (indices into `seqs`), each epoch freshly shuffled.

    Under SP every role's turns are in one adapter's stream; under IP each adapter
    has its own, and its number of optimizer steps is ceil(turns / size) x epochs.
    """
    by_policy: dict[str, list[int]] = defaultdict(list)
    for i, s in enumerate(seqs):
        by_policy[s.policy].append(i)
    plan: dict[str, list[list[int]]] = {}
    for p in sorted(by_policy):
        mbs = []
        for _ in range(epochs):
            order = list(by_policy[p])
            rng.shuffle(order)
            mbs += [order[k : k + size] for k in range(0, len(order), size)]
        plan[p] = mbs
    return plan


def micro_batches(
    seqs: list[Sequence], idx: list[int], size: int, max_tokens: int, row_tokens: int
) -> list[list[int]]:
    """Role-pure micro-batches, at most `size` sequences and `max_tokens` padded positions
    each, sequences with the same prompt together (they share forward rows up to
    `row_tokens` positions, prompt_rows.py), then by length: little padding, bounded
    memory, and each role's part of the gradient can be read apart."""
    by_role: dict[str, list[int]] = defaultdict(list)
    for i in idx:
        by_role[seqs[i].role].append(i)
    out = []
    for role in sorted(by_role):
        out += pack_rows(seqs, by_role[role], size, max_tokens, row_tokens)
    return out


def completion_logprobs(
    policy: MultiAdapterPolicy,
    chunk: list[Sequence],
    temperature: float,
    entropy: bool = False,
    row_tokens: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """log π of every completion token of `chunk` (one forward), concatenated in sequence
    order, the entropies there if asked, and each sequence's completion length. The
    decoder runs over the chunk's rows (prompts shared up to `row_tokens` positions a row,
    prompt_rows.py); logits exist only at completion positions, a chunk at a time
    (MultiAdapterPolicy.token_logprobs)."""
    rows = policy.row_layout(chunk, row_tokens)
    feats = policy.row_features(rows)
    logp, ent = policy.token_logprobs(feats, rows.targets, temperature, entropy)
    return logp, ent, rows.lengths


def _ranked(
    seqs: list[Sequence], chunks: list[list[int]], rank: int, size: int
) -> list[tuple[list[int], bool]]:
    """This rank's part of `chunks` as (chunk, real) pairs, as many on every rank. With
    FSDP every forward gathers each layer's shards from all ranks, so the ranks must run
    the same number of them: a rank short of work repeats a chunk with `real` False (its
    loss weighted 0). Chunks are split by padded tokens, role by role, so at every
    position of the list all ranks back-propagate the same role."""
    if size == 1:
        return [(c, True) for c in chunks]
    out: list[tuple[list[int], bool]] = []
    for role in dict.fromkeys(seqs[c[0]].role for c in chunks):
        of_role = [c for c in chunks if seqs[c[0]].role == role]
        loads = [len(c) * max(len(seqs[i].tokens) for i in c) for c in of_role]
        parts = [fsdp.share(loads, r, size) for r in range(size)]
        mine = [(of_role[k], True) for k in parts[rank]]
        filler = min(of_role, key=lambda c: loads[of_role.index(c)])
        out += mine + [(filler, False)] * (max(map(len, parts)) - len(mine))
    return out


def _merge_old(old: list[torch.Tensor | None], device: torch.device) -> None:
    """Every rank's π_old log-probs into every rank's `old` (collective)."""
    if fsdp.rank_and_size()[1] == 1:
        return
    mine = {i: o.cpu() for i, o in enumerate(old) if o is not None}
    for part in fsdp.gather(mine):
        for i, o in part.items():
            if old[i] is None:
                old[i] = o.to(device)


@torch.no_grad()
def _old_logprobs(
    policy: MultiAdapterPolicy,
    seqs: list[Sequence],
    idx: list[int],
    temperature: float,
    micro: int,
    max_tokens: int,
    row_tokens: int,
    old: list[torch.Tensor | None],
) -> None:
    chunks = micro_batches(seqs, idx, micro, max_tokens, row_tokens)
    for chunk, real in _ranked(seqs, chunks, policy.rank, policy.world_size):
        logp, _, lengths = completion_logprobs(
            policy, [seqs[i] for i in chunk], temperature, row_tokens=row_tokens
        )
        if real:
            for i, part in zip(chunk, logp.split(lengths), strict=True):
                old[i] = part.clone()
    _merge_old(old, policy.device)


def behaviour_weights(old: torch.Tensor, sample_logprobs: list[float], cap: float) -> torch.Tensor:
    """π_old/μ per token, truncated at `cap`: μ's log-probs are what inference reported."""
    mu = torch.tensor(sample_logprobs[: len(old)], dtype=old.dtype, device=old.device)
    return torch.exp(old - mu).clamp(max=cap)


@dataclass
class ImportanceStats:
    tokens: int = 0
    total: float = 0.0
    truncated: int = 0

    def add(self, weights: torch.Tensor, cap: float) -> None:
        self.tokens += len(weights)
        self.total += float(weights.sum())
        self.truncated += int((weights >= cap).sum())

    def metrics(self) -> dict[str, float]:
        n = max(self.tokens, 1)
        return {
            "train/importance_weight_mean": self.total / n,
            "train/importance_truncated_fraction": self.truncated / n,
        }


def _grads(policy: MultiAdapterPolicy, p: str) -> list[torch.Tensor]:
    """The adapter's accumulated gradient, whole (gathered from every rank's shard)."""
    return [
        fsdp.full(x.grad.detach()).clone()
        if x.grad is not None
        else torch.zeros((), device=policy.device)
        for x in policy.parameters(p)
    ]


def grpo_step(
    policy: MultiAdapterPolicy,
    rollouts: list[Rollout],
    groups: list[str],
    policy_of_role: dict[str, str],
    spec: RunSpec,
) -> StepResult:
    g = spec.grpo
    temperature = spec.sampling.temperature
    keep, dropped = good_rollouts([r.error is not None for r in rollouts], groups)
    rollouts = [rollouts[i] for i in keep]
    groups = [groups[i] for i in keep]
    advantages = group_advantages([r.reward for r in rollouts], groups, g.normalize_std)
    seqs = build_sequences(rollouts, advantages, policy_of_role)
    result = StepResult(
        {
            "train/lr": policy.lr(),
            **{f"policy/{p}/lr": policy.lr(p) for p in policy.policies},
            "train/sequences": len(seqs),
            "train/groups_dropped": dropped,
        }
    )
    # seeded by the step, so a resumed run shuffles as an uninterrupted one
    rng = random.Random(spec.seed * 1_000_003 + policy.updates)
    plan = plan_mini_batches(seqs, g.sequences_per_mini_batch, g.epochs, rng)
    signals = diagnostics.RoleSignals()
    off_policy = spec.train.max_staleness > 0
    importance = ImportanceStats()
    old: list[torch.Tensor | None] = [None] * len(seqs)
    diag_s = 0.0
    budget = g.max_tokens_per_micro_batch
    row_tokens = g.row_tokens
    policy.set_activation_checkpointing(g.activation_checkpointing)
    policy.model.train()
    for p, mbs in plan.items():
        policy.activate(p)
        first = set(mbs[0])
        rest = sorted({i for mb in mbs for i in mb} - first)
        _old_logprobs(
            policy, seqs, rest, temperature, g.micro_batch_sequences, budget, row_tokens, old
        )
        per_epoch = len(mbs) // g.epochs
        for k, mb in enumerate(mbs):
            lengths = [len(seqs[i].tokens) - seqs[i].n_prompt for i in mb]
            weight_of = dict(zip(mb, token_weights(lengths, g.loss_agg), strict=True))
            st = MiniBatchStats(p, k, len(mb), 0.0, 0.0)
            before: list[torch.Tensor] | None = None
            chunks = _ranked(
                seqs,
                micro_batches(seqs, mb, g.micro_batch_sequences, budget, row_tokens),
                policy.rank,
                policy.world_size,
            )
            updates: list[tuple[str, LossStats, float | None]] = []
            for c, (chunk, real) in enumerate(chunks):
                role = seqs[chunk[0]].role
                t0 = time.perf_counter()
                if k == 0 and before is None:
                    before = _grads(policy, p)
                diag_s += time.perf_counter() - t0
                # flat over the chunk's completion tokens: no padding, no prompt positions
                logp, ent, lengths = completion_logprobs(
                    policy,
                    [seqs[i] for i in chunk],
                    temperature,
                    entropy=k < per_epoch,
                    row_tokens=row_tokens,
                )
                olds, ws, advs = [], [], []
                for i, part, n in zip(chunk, logp.split(lengths), lengths, strict=True):
                    o = old[i]
                    if o is None:  # the first mini-batch: π_old is this very forward
                        o = old[i] = part.detach().clone()
                    olds.append(o)
                    w = torch.full((n,), weight_of[i] if real else 0.0, device=logp.device)
                    if off_policy:
                        iw = behaviour_weights(o, seqs[i].sample_logprobs, g.importance_cap)
                        if real:
                            importance.add(iw, g.importance_cap)
                        w = w * iw
                    ws.append(w)
                    advs.append(torch.full((n,), seqs[i].advantage, device=logp.device))
                loss, ls = clipped_loss(
                    logp,
                    torch.cat(olds),
                    torch.cat(advs),
                    torch.ones_like(logp),
                    g.clip_low,
                    g.clip_high,
                    torch.cat(ws),
                )
                loss.backward()
                if real:
                    updates.append((role, ls, float(ent.sum()) if ent is not None else None))
                t0 = time.perf_counter()
                last_of_role = c + 1 == len(chunks) or seqs[chunks[c + 1][0][0]].role != role
                if before is not None and last_of_role:
                    # this role's part of the first mini-batch's gradient, read apart
                    after = _grads(policy, p)
                    sq = sum(
                        float(((a - z) ** 2).sum()) for a, z in zip(after, before, strict=True)
                    )
                    signals.add_grad(role, sq**0.5)
                    before = None
                diag_s += time.perf_counter() - t0
            for part in fsdp.gather(updates):
                for role, ls, entropy in part:
                    st.loss += ls.loss
                    st.tokens += ls.tokens
                    st.clipped_low += ls.clipped_low
                    st.clipped_high += ls.clipped_high
                    st.ratio_min = min(st.ratio_min, ls.ratio_min)
                    st.ratio_max = max(st.ratio_max, ls.ratio_max)
                    signals.add_update(role, ls.tokens, ls.clipped_low + ls.clipped_high, entropy)
            if k == 0:
                _merge_old(old, policy.device)
            st.grad_norm = policy.step(p)
            result.mini_batches.append(st)
    policy.model.eval()

    t0 = time.perf_counter()
    final_old = [o if o is not None else torch.zeros(0) for o in old]
    signals.add_old(seqs, final_old)
    picked = diagnostics.sample_tokens(seqs, diagnostics.SAMPLE_TOKENS_PER_ROLE, rng)
    diagnostics.sampled_drift(
        policy,
        seqs,
        final_old,
        picked,
        temperature,
        g.micro_batch_sequences,
        signals,
        budget,
        row_tokens,
    )
    diag_s += time.perf_counter() - t0
    policy.end_step()

    m = result.metrics
    m.update(signals.metrics())
    per_policy: dict[str, list[MiniBatchStats]] = defaultdict(list)
    for st in result.mini_batches:
        per_policy[st.policy].append(st)
    for p, sts in per_policy.items():
        m[f"policy/{p}/optimizer_steps"] = len(sts)
        m[f"policy/{p}/grad_norm"] = sum(s.grad_norm for s in sts) / len(sts)
        m[f"policy/{p}/loss"] = sum(s.loss for s in sts) / len(sts)
        tokens = max(sum(s.tokens for s in sts), 1)
        m[f"policy/{p}/clip_low_fraction"] = sum(s.clipped_low for s in sts) / tokens
        m[f"policy/{p}/clip_high_fraction"] = sum(s.clipped_high for s in sts) / tokens
    m["time/diagnostics_s"] = diag_s
    if off_policy:
        for part in fsdp.gather(importance)[1:]:
            importance.tokens += part.tokens
            importance.total += part.total
            importance.truncated += part.truncated
        m.update(importance.metrics())
    return result
