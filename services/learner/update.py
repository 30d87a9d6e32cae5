"""One GRPO step over a step's rollouts, with mini-batches counted as the paper counts them.

Read `grpo_step` top to bottom: failed episodes leave their groups; advantages are
group-relative over the rest; every role turn becomes a sequence; each adapter's
sequences are shuffled into mini-batches (batching.py), one AdamW step each, so an
adapter serving more turns takes more steps (Voting-IP's generator 3, its aggregator 1 at
the paper's defaults). π_old is the policy before the step's first update: the first
mini-batch's own forward (detached) gives it for its sequences, one no-grad forward before
that update gives it for the others; every later mini-batch is off-policy, so ratios,
clipping and clip fractions are real. A mini-batch is micro-batches of chunks, each a
forward, its loss (grpo.py) and a backward; then the optimizer step.

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

The advantages come from advantages.py, the mitigations from role_balance.py; the
per-role signals are an observer the step calls (diagnostics.py); records.py names the
record.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

from marl.diagnostics.signatures import parallel_roles
from marl.rollout import Rollout
from marl.runtime import tracing
from marl.spec.run import GRPOSpec, RunSpec
from services.learner import fsdp
from services.learner.advantages import step_advantages
from services.learner.batching import (
    Chunk,
    by_role,
    forward_chunks,
    plan_mini_batches,
    pooled_units,
)
from services.learner.diagnostics import StepDiagnostics
from services.learner.grpo import (
    LossInputs,
    LossStats,
    behaviour_weights,
    grpo_loss,
    token_weights,
)
from services.learner.policy import MultiAdapterPolicy
from services.learner.records import update_metrics
from services.learner.role_balance import RoleBalance, slot_scale
from services.learner.sequences import Sequence, build_sequences, turn_owners


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
    kl: float = 0.0
    """The mini-batch's KL estimate to the base model, weighted as the loss (kl_coef > 0)."""

    def add(self, stats: LossStats, kl: float) -> None:
        """One micro-batch's loss stats (from any rank)."""
        self.kl += kl
        self.loss += stats.loss
        self.tokens += stats.tokens
        self.clipped_low += stats.clipped_low
        self.clipped_high += stats.clipped_high
        self.ratio_min = min(self.ratio_min, stats.ratio_min)
        self.ratio_max = max(self.ratio_max, stats.ratio_max)


@dataclass
class StepResult:
    metrics: dict[str, float]
    mini_batches: list[MiniBatchStats] = field(default_factory=list)


@dataclass
class Step:
    """What the step's mini-batches share: its sequences and the log-probs filled in as
    they run, the options that weigh them, and the observer of it all."""

    spec: RunSpec
    seqs: list[Sequence]
    slot_scale: list[float] | None
    balance: RoleBalance
    watch: StepDiagnostics
    old: list[torch.Tensor | None] = field(init=False)
    """π_old's log-probs of each sequence's completion tokens."""
    ref: list[torch.Tensor | None] = field(init=False)
    """The base model's (kl_coef > 0), once a step."""

    def __post_init__(self) -> None:
        self.old = [None] * len(self.seqs)
        self.ref = [None] * len(self.seqs)


@dataclass
class PendingDrift:
    """What a step leaves for its per-role signals (π_old's and the sampled drift,
    diagnostics.py) when they are measured after its push (`grpo_step`'s `drift_later`)."""

    seqs: list[Sequence]
    old: list[torch.Tensor | None]
    rng: random.Random
    """The step's generator, where the update left it: the same tokens are sampled as in
    a step that measures at once."""
    temperature: float
    grpo: GRPOSpec
    watch: StepDiagnostics

    def measure(self, policy: MultiAdapterPolicy) -> dict[str, float]:
        self.watch.step_ends(
            policy, self.seqs, self.old, self.rng, self.temperature, self.grpo
        )
        return self.watch.metrics()


def grpo_step(
    policy: MultiAdapterPolicy,
    rollouts: list[Rollout],
    groups: list[str],
    policy_of_role: dict[str, str],
    spec: RunSpec,
    drift_later: bool = False,
) -> StepResult:
    """Train every adapter on the step's `rollouts` (`groups`: each one's problem) and
    advance their schedules; `policy_of_role`: role -> adapter. `drift_later`: the per-role
    signals are left for `measure_drift`, which the learner calls once the next step's
    tasks are out, so that their forward runs beside that step's generation; the policy
    must not change in between."""
    started = time.monotonic()  # the "grpo step" span, on the thread that runs it
    g = spec.grpo
    adv = step_advantages(rollouts, groups, spec)
    rollouts, rewards = adv.rollouts, adv.rewards
    seqs = build_sequences(rollouts, adv.per_rollout, policy_of_role)
    if adv.per_sequence is not None:
        for s, a in zip(seqs, adv.per_sequence, strict=True):
            s.advantage = a
    parallel = parallel_roles(spec.workflow) or ()
    owners = turn_owners(rollouts)
    units = pooled_units(seqs, owners, parallel) if g.parallel_slots == "pool" else None
    # seeded by the step, so a resumed run shuffles as an uninterrupted one
    rng = random.Random(spec.seed * 1_000_003 + policy.updates)
    plan = plan_mini_batches(seqs, g.sequences_per_mini_batch, g.epochs, rng, units)
    step = Step(
        spec,
        seqs,
        slot_scale(seqs, owners, parallel, g),
        RoleBalance(g, policy_of_role),
        StepDiagnostics(off_policy=spec.train.max_staleness > 0),
    )
    mini_batches = []
    policy.set_activation_checkpointing(g.activation_checkpointing)
    policy.set_compiled(g.torch_compile)
    policy.set_varlen(g.varlen_attention)
    policy.model.train()
    for p, mbs in plan.items():
        policy.activate(p)
        old_logprobs(policy, step, sorted({i for mb in mbs for i in mb} - set(mbs[0])))
        per_epoch = len(mbs) // g.epochs
        for k, mb in enumerate(mbs):
            mini_batches.append(train_mini_batch(policy, step, p, k, mb, k < per_epoch))
    policy.model.eval()
    drift = PendingDrift(seqs, step.old, rng, spec.sampling.temperature, g, step.watch)
    policy.pending_drift = drift if drift_later else None
    routed = set(policy_of_role.values())
    metrics = update_metrics(
        lr=policy.lr(),
        lrs={p: policy.lr(p) for p in policy.policies if p in routed},
        sequences=len(seqs),
        groups_dropped=adv.groups_dropped,
        penalties=(
            [a - r.reward for a, r in zip(rewards, rollouts, strict=True)] if g.overlong else None
        ),
        diagnostics={} if drift_later else drift.measure(policy),
        mini_batches=mini_batches,
        kl=g.kl_coef > 0,
        balance_scales=step.balance.scales,
    )
    policy.end_step()
    tracing.add("grpo step", started, time.monotonic())
    return StepResult(metrics, mini_batches)


def measure_drift(policy: MultiAdapterPolicy) -> dict[str, float]:
    """The per-role signals of the step `grpo_step` trained last with `drift_later` ({}
    when it measured them itself); collective, as the update is."""
    pending, policy.pending_drift = policy.pending_drift, None
    if pending is None:
        return {}
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads // 2))
    try:
        return pending.measure(policy)
    finally:
        torch.set_num_threads(threads)


def train_mini_batch(
    policy: MultiAdapterPolicy, step: Step, p: str, k: int, mb: list[int], first_epoch: bool
) -> MiniBatchStats:
    """Adapter `p`'s k-th mini-batch: its micro-batches, role by role, each a forward and
    a backward, then one optimizer step. `first_epoch`: its forwards give the entropy."""
    g, seqs = step.spec.grpo, step.seqs
    lengths = [len(seqs[i].tokens) - seqs[i].n_prompt for i in mb]
    weight_of = dict(zip(mb, token_weights(lengths, g.loss_agg), strict=True))
    if step.slot_scale is not None:
        weight_of = {i: w * step.slot_scale[i] for i, w in weight_of.items()}
    step.balance.mini_batch({seqs[i].role for i in mb})
    step.watch.mini_batch_starts(p)
    updates: list[tuple[str, LossStats, float | None, float]] = []
    chunks_of_mb = forward_chunks(
        seqs, mb, g, policy.rank, policy.world_size, varlen=policy.varlen
    )
    for role, chunks in by_role(seqs, chunks_of_mb):
        step.watch.role_starts(policy, p)
        step.balance.role_starts(policy, p)
        for chunk in chunks:
            inputs = loss_inputs(policy, step, chunk, weight_of, first_epoch)
            out = grpo_loss(
                inputs, clip_low=g.clip_low, clip_high=g.clip_high, kl_coef=g.kl_coef,
                kl_estimator=g.kl_estimator, entropy_coef=g.entropy_coef,
            )
            out.loss.backward()
            if chunk[1]:
                ent = inputs.entropy
                entropy = float(ent.detach().sum()) if first_epoch and ent is not None else None
                updates.append((role, out.stats, entropy, out.kl))
        step.watch.role_ends(policy, p, role)
        step.balance.role_ends(policy, p, role)
    st = MiniBatchStats(p, k, len(mb), 0.0, 0.0)
    for part in fsdp.gather(updates):
        for role, stats, entropy, kl in part:
            st.add(stats, kl)
            step.watch.updated(role, stats, entropy)
    if k == 0:
        fsdp.merge(step.old, policy.device)
    step.balance.rescale(policy, p)
    st.grad_norm = policy.step(p)
    return st


def loss_inputs(
    policy: MultiAdapterPolicy,
    step: Step,
    chunk: Chunk,
    weight_of: dict[int, float],
    first_epoch: bool,
) -> LossInputs:
    """One micro-batch's forward, and what its loss takes: π_old (this very forward on the
    first mini-batch), the tokens' weights (times π_old/μ off-policy), their advantages,
    the base model's log-probs (kl_coef > 0) and the entropies (first epoch, or a bonus)."""
    g, seqs = step.spec.grpo, step.seqs
    idx, real = chunk
    temperature = step.spec.sampling.temperature
    # flat over the chunk's completion tokens: no padding, no prompt positions
    logp, ent, lengths = completion_logprobs(
        policy, [seqs[i] for i in idx], temperature, entropy=first_epoch or g.entropy_coef > 0,
        row_tokens=g.row_tokens, entropy_grad=g.entropy_coef > 0,
    )
    if g.kl_coef > 0 and any(step.ref[i] is None for i in idx):
        with torch.no_grad():
            base, _, _ = completion_logprobs(
                policy, [seqs[i] for i in idx], temperature, row_tokens=g.row_tokens, base=True
            )
        for i, part in zip(idx, base.split(lengths), strict=True):
            step.ref[i] = part
    olds, weights, advantages = [], [], []
    for i, part, n in zip(idx, logp.split(lengths), lengths, strict=True):
        o = step.old[i]
        if o is None:  # the first mini-batch: π_old is this very forward
            o = step.old[i] = part.detach().clone()
        olds.append(o)
        w = torch.full((n,), weight_of[i] if real else 0.0, device=logp.device)
        if step.spec.train.max_staleness > 0:  # off-policy: π_old/μ
            iw = behaviour_weights(o, seqs[i].sample_logprobs, g.importance_cap)
            if real:
                step.watch.weighted(iw, g.importance_cap)
            w = w * iw
        weights.append(w)
        advantages.append(torch.full((n,), seqs[i].advantage, device=logp.device))
    refs = [r for r in (step.ref[i] for i in idx) if r is not None]
    assert ent is not None or g.entropy_coef == 0
    return LossInputs(
        logp, torch.cat(olds), torch.cat(advantages), torch.cat(weights),
        seq_lengths=lengths if g.ratio_level == "sequence" else None,
        ref_logp=torch.cat(refs) if g.kl_coef > 0 else None,
        entropy=ent,
    )


@torch.no_grad()
def old_logprobs(policy: MultiAdapterPolicy, step: Step, idx: list[int]) -> None:
    """π_old of sequences `idx` (those after an adapter's first mini-batch), before its
    first update; every rank's share merged."""
    g, seqs = step.spec.grpo, step.seqs
    for chunk, real in forward_chunks(
        seqs, idx, g, policy.rank, policy.world_size, varlen=policy.varlen
    ):
        logp, _, lengths = completion_logprobs(
            policy, [seqs[i] for i in chunk], step.spec.sampling.temperature,
            row_tokens=g.row_tokens,
        )
        if real:
            for i, part in zip(chunk, logp.split(lengths), strict=True):
                step.old[i] = part.clone()
    fsdp.merge(step.old, policy.device)


def completion_logprobs(
    policy: MultiAdapterPolicy,
    chunk: list[Sequence],
    temperature: float,
    entropy: bool = False,
    row_tokens: int = 0,
    entropy_grad: bool = False,
    base: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """log π of every completion token of `chunk` (one forward), concatenated in sequence
    order, the entropies there if asked, and each sequence's completion length. The
    decoder runs over the chunk's rows (prompts shared up to `row_tokens` positions a row,
    prompt_rows.py); logits exist only at completion positions, a chunk at a time
    (MultiAdapterPolicy.token_logprobs). `base`: the base model's, every adapter off."""
    rows = policy.row_layout(chunk, row_tokens)
    feats = policy.row_features(rows, base=base)
    logp, ent = policy.token_logprobs(feats, rows.targets, temperature, entropy, entropy_grad)
    return logp, ent, rows.lengths
