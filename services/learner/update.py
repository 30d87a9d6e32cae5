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

The objective options (GRPOSpec: KL to the base model, entropy bonus, GSPO's sequence
ratio, RLOO, per-role normalisation, DAPO's overlong band) and the mitigations of the
paper's mechanisms (`parallel_slots`, `role_balance`) are applied here; every one is off
by default, and then the step is the paper's to the last bit (tests/unit/test_objectives.py).
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import torch

from marl.diagnostics.signatures import parallel_roles
from marl.rollout import Rollout
from marl.spec.run import RunSpec, SpecError, response_cap
from services.learner import diagnostics, fsdp, role_rewards
from services.learner.grpo import (
    LossStats,
    clipped_loss,
    good_rollouts,
    group_advantages,
    kl_penalty,
    overlong_penalty,
    signal_groups,
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
    kl: float = 0.0
    """The mini-batch's KL estimate to the base model, weighted as the loss (kl_coef > 0)."""


@dataclass
class StepResult:
    metrics: dict[str, float]
    mini_batches: list[MiniBatchStats] = field(default_factory=list)


def plan_mini_batches(
    seqs: list[Sequence],
    size: int,
    epochs: int,
    rng: random.Random,
    units: list[int] | None = None,
) -> dict[str, list[list[int]]]:
    """Adapter -> its mini-batches (indices into `seqs`), each epoch freshly shuffled.

    Under SP every role's turns are in one adapter's stream; under IP each adapter
    has its own, and its number of optimizer steps is ceil(turns / size) x epochs.
    `units` (`grpo.parallel_slots: pool`): sequences with the same unit id count as one
    sample, go to the same mini-batch, and a mini-batch holds `size` units.
    """
    by_policy: dict[str, list[int]] = defaultdict(list)
    for i, s in enumerate(seqs):
        by_policy[s.policy].append(i)
    plan: dict[str, list[list[int]]] = {}
    for p in sorted(by_policy):
        mbs = []
        if units is None:
            for _ in range(epochs):
                order = list(by_policy[p])
                rng.shuffle(order)
                mbs += [order[k : k + size] for k in range(0, len(order), size)]
        else:
            members: dict[int, list[int]] = defaultdict(list)
            for i in by_policy[p]:
                members[units[i]].append(i)
            for _ in range(epochs):
                keys = list(members)
                rng.shuffle(keys)
                mbs += [
                    [i for u in keys[k : k + size] for i in members[u]]
                    for k in range(0, len(keys), size)
                ]
        plan[p] = mbs
    return plan


def shaped_rewards(rollouts: list[Rollout], spec: RunSpec) -> list[float]:
    """Each rollout's reward as the advantages see it: with `grpo.overlong`, plus DAPO's
    soft overlong penalty of its longest turn."""
    g = spec.grpo
    if g.overlong == 0:
        return [r.reward for r in rollouts]
    cap = response_cap(spec)
    return [
        r.reward
        + overlong_penalty(
            max((len(t.completion_ids) for t in r.turns), default=0),
            cap,
            g.overlong,
            g.overlong_penalty,
        )
        for r in rollouts
    ]


def groups_with_signal(rollouts: list[Rollout], spec: RunSpec) -> list[str]:
    """The problems (groups) of `rollouts` that train and carry a comparison, in the order
    they first appear: at least two good rollouts whose rewards (as shaped) differ."""
    groups = [r.problem_id for r in rollouts]
    keep, _ = good_rollouts([r.error is not None for r in rollouts], groups)
    good = [rollouts[i] for i in keep]
    live = signal_groups(shaped_rewards(good, spec), [r.problem_id for r in good])
    return [g for g in dict.fromkeys(groups) if g in live]


async def dynamic_sampling(
    rollouts: list[Rollout],
    more: Callable[[int], Awaitable[list[Rollout]]],
    spec: RunSpec,
) -> tuple[list[Rollout], list[Rollout], dict[str, float]]:
    """DAPO's dynamic sampling (`grpo.dynamic_sampling`): while the step has fewer than
    `train.problems_per_step` groups with signal, `more(n)` runs n further problems
    (the next ones in the data order), at most `grpo.dynamic_sampling_rounds` times.
    Returns every rollout gathered, those of the first problems_per_step groups with
    signal (what trains), and the step's record of it."""
    target = spec.train.problems_per_step
    rounds = 0
    live = groups_with_signal(rollouts, spec)
    while len(live) < target and rounds < spec.grpo.dynamic_sampling_rounds:
        rollouts = rollouts + await more(target - len(live))
        rounds += 1
        live = groups_with_signal(rollouts, spec)
    kept = set(live[:target])
    sampled = len({r.problem_id for r in rollouts})
    return (
        rollouts,
        [r for r in rollouts if r.problem_id in kept],
        {
            "train/dynamic_sampling_dropped": 1.0 - len(live) / max(sampled, 1),
            "train/dynamic_sampling_rounds": rounds,
            "train/dynamic_sampling_groups": len(kept),
        },
    )


def spec_problems(spec: RunSpec, roles: dict[str, str]) -> None:
    """The objective options and mitigations a spec sets that make no sense for it, as a
    SpecError naming the field (INVALID_ARGUMENT at submit). `roles`: role -> adapter."""
    g = spec.grpo
    served: dict[str, list[str]] = defaultdict(list)
    for role, adapter in roles.items():
        served[adapter].append(role)
    shared = sorted(a for a, rs in served.items() if len(rs) > 1)
    if spec.guard.on_alarm.get("sp_role_capture") == "split" and not shared:
        raise SpecError(
            "field `guard.on_alarm.sp_role_capture`: split gives a captured role an adapter "
            "of its own, but every adapter of this run serves one role already "
            f"(policy: {spec.policy}); use warn, stop or rollback, or share an adapter"
        )
    if g.role_balance != "none" and not shared:
        raise SpecError(
            f"field `grpo.role_balance`: {g.role_balance} balances the roles of an adapter "
            "that serves several, and no adapter of this run does; set it to none"
        )
    unknown = sorted(set(g.role_weights) - set(roles))
    if unknown:
        raise SpecError(
            f"field `grpo.role_weights`: {', '.join(map(repr, unknown))} is no role of "
            f"{spec.workflow}; its roles are {', '.join(roles)}"
        )
    if g.parallel_slots != "each" and not parallel_roles(spec.workflow):
        why = (
            "marl does not know which roles of a user workflow run in parallel"
            if parallel_roles(spec.workflow) is None
            else f"{spec.workflow} has no parallel same-role slots"
        )
        raise SpecError(
            f"field `grpo.parallel_slots`: {g.parallel_slots} acts on parallel slots, and "
            f"{why}; set it to each"
        )
    if g.advantage_norm == "role" and len(roles) < 2:
        raise SpecError(
            f"field `grpo.advantage_norm`: role normalises each role apart, and {spec.workflow} "
            "has one role (it equals workflow); set it to workflow"
        )
    if g.overlong >= response_cap(spec):
        raise SpecError(
            f"field `grpo.overlong`: the band ({g.overlong} tokens) must be shorter than the "
            f"response cap ({response_cap(spec)}: sampling.max_tokens or the task's)"
        )
    if spec.train.val_pass_at and spec.sampling.val_temperature == 0:
        raise SpecError(
            "field `train.val_pass_at`: pass@k needs different samples of each problem, and "
            "sampling.val_temperature is 0 (greedy); raise it, e.g. to 0.7"
        )


def turn_owners(rollouts: list[Rollout]) -> list[int]:
    """The rollout of each sequence build_sequences makes, in its order."""
    return [k for k, r in enumerate(rollouts) for t in r.turns if t.completion_ids]


def sequence_advantages(
    rollouts: list[Rollout], rewards: list[float], groups: list[str], spec: RunSpec
) -> list[float] | None:
    """Per-sequence advantages under `grpo.advantage_norm: role` (Dr. MAS): each role's
    turns normalised over that role's turns in the group, each carrying its rollout's
    reward. None under `workflow` (one advantage per rollout)."""
    g = spec.grpo
    if g.advantage_norm == "workflow":
        return None
    owners = turn_owners(rollouts)
    roles = [t.role for r in rollouts for t in r.turns if t.completion_ids]
    return group_advantages(
        [rewards[k] for k in owners],
        [(groups[k], role) for k, role in zip(owners, roles, strict=True)],
        g.normalize_std,
        baseline=g.baseline,
    )


def parallel_slot_counts(
    seqs: list[Sequence], owners: list[int], parallel: tuple[str, ...]
) -> list[int]:
    """Per sequence: how many turns of its role its rollout has when the role is a parallel
    one (Voting's generators, Orch-Workers' workers), else 1."""
    count: dict[tuple[int, str], int] = defaultdict(int)
    for s, k in zip(seqs, owners, strict=True):
        count[(k, s.role)] += 1
    return [
        count[(k, s.role)] if s.role in parallel else 1
        for s, k in zip(seqs, owners, strict=True)
    ]


def pooled_units(seqs: list[Sequence], owners: list[int], parallel: tuple[str, ...]) -> list[int]:
    """`parallel_slots: pool`: a parallel role's turns of one rollout share a unit id."""
    ids: dict[tuple[int, str], int] = {}
    units = []
    for i, (s, k) in enumerate(zip(seqs, owners, strict=True)):
        key = (k, s.role) if s.role in parallel else (-1 - i, s.role)
        units.append(ids.setdefault(key, len(ids)))
    return units


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


def _local_grads(policy: MultiAdapterPolicy, p: str) -> list[torch.Tensor]:
    """The adapter's accumulated gradient as this rank holds it (its shard)."""
    return [
        x.grad.detach().clone() if x.grad is not None else torch.zeros_like(x)
        for x in policy.parameters(p)
    ]


def balance_roles(
    policy: MultiAdapterPolicy,
    p: str,
    parts: dict[str, list[torch.Tensor]],
    weights: dict[str, float],
) -> dict[str, float]:
    """`grpo.role_balance`: the adapter's gradient becomes Σ_r c_r g_r with
    c_r = (w_r / Σw) (Σ_q ‖g_q‖) / ‖g_r‖ over the roles whose part is not zero, so each
    role's share of the gradient mass is its weight's and the total mass is kept. Returns
    each role's c_r."""
    norms = {
        r: sum(float((fsdp.full(d) ** 2).sum()) for d in g) ** 0.5 for r, g in parts.items()
    }
    live = [r for r in parts if norms[r] > 0]
    if len(live) < 2:
        return {}
    total = sum(norms[r] for r in live)
    wsum = sum(weights.get(r, 1.0) for r in live)
    scale = {r: weights.get(r, 1.0) / wsum * total / norms[r] for r in live}
    for j, x in enumerate(policy.parameters(p)):
        x.grad = sum((scale[r] * parts[r][j] for r in live[1:]), scale[live[0]] * parts[live[0]][j])
    return scale


def grpo_step(  # noqa: C901, PLR0915 (older than the limit; split it when next changed)
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
    rewards = shaped_rewards(rollouts, spec)
    advantages = group_advantages(rewards, groups, g.normalize_std, baseline=g.baseline)
    seqs = build_sequences(rollouts, advantages, policy_of_role)
    per_turn = sequence_advantages(rollouts, rewards, groups, spec)
    if role_rewards.present(rollouts):  # roles rewarded apart: each normalised over its own
        per_turn = role_rewards.sequence_advantages(
            rollouts, rewards, groups, g.normalize_std, g.baseline)
    if per_turn is not None:
        for s, a in zip(seqs, per_turn, strict=True):
            s.advantage = a
    routed = set(policy_of_role.values())
    result = StepResult(
        {
            "train/lr": policy.lr(),
            **{f"policy/{p}/lr": policy.lr(p) for p in policy.policies if p in routed},
            "train/sequences": len(seqs),
            "train/groups_dropped": dropped,
        }
    )
    if g.overlong:
        penalties = [a - r.reward for a, r in zip(rewards, rollouts, strict=True)]
        result.metrics["train/overlong_penalty_mean"] = sum(penalties) / max(len(penalties), 1)
    parallel = parallel_roles(spec.workflow) or ()
    owners = turn_owners(rollouts)
    slot_scale = (
        [1.0 / n for n in parallel_slot_counts(seqs, owners, parallel)]
        if g.parallel_slots == "scale"
        else None
    )
    units = pooled_units(seqs, owners, parallel) if g.parallel_slots == "pool" else None
    # seeded by the step, so a resumed run shuffles as an uninterrupted one
    rng = random.Random(spec.seed * 1_000_003 + policy.updates)
    plan = plan_mini_batches(seqs, g.sequences_per_mini_batch, g.epochs, rng, units)
    signals = diagnostics.RoleSignals()
    off_policy = spec.train.max_staleness > 0
    importance = ImportanceStats()
    old: list[torch.Tensor | None] = [None] * len(seqs)
    ref: list[torch.Tensor | None] = [None] * len(seqs)
    """The base model's log-probs of each sequence's tokens (kl_coef > 0), once a step."""
    balance_scales: dict[str, list[float]] = defaultdict(list)
    weights_of_roles = (
        {r: 1.0 for r in policy_of_role} if g.role_balance == "equal" else g.role_weights
    )
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
            if slot_scale is not None:
                weight_of = {i: w * slot_scale[i] for i, w in weight_of.items()}
            st = MiniBatchStats(p, k, len(mb), 0.0, 0.0)
            before: list[torch.Tensor] | None = None
            balance = g.role_balance != "none" and len({seqs[i].role for i in mb}) > 1
            role_parts: dict[str, list[torch.Tensor]] = {}
            role_start: list[torch.Tensor] | None = None
            chunks = _ranked(
                seqs,
                micro_batches(seqs, mb, g.micro_batch_sequences, budget, row_tokens),
                policy.rank,
                policy.world_size,
            )
            updates: list[tuple[str, LossStats, float | None, float]] = []
            for c, (chunk, real) in enumerate(chunks):
                role = seqs[chunk[0]].role
                t0 = time.perf_counter()
                if k == 0 and before is None:
                    before = _grads(policy, p)
                diag_s += time.perf_counter() - t0
                if balance and role_start is None:
                    role_start = _local_grads(policy, p)
                # flat over the chunk's completion tokens: no padding, no prompt positions
                logp, ent, lengths = completion_logprobs(
                    policy,
                    [seqs[i] for i in chunk],
                    temperature,
                    entropy=k < per_epoch or g.entropy_coef > 0,
                    row_tokens=row_tokens,
                    entropy_grad=g.entropy_coef > 0,
                )
                if g.kl_coef > 0 and any(ref[i] is None for i in chunk):
                    with torch.no_grad():
                        base_logp, _, _ = completion_logprobs(
                            policy, [seqs[i] for i in chunk], temperature,
                            row_tokens=row_tokens, base=True,
                        )
                    for i, part in zip(chunk, base_logp.split(lengths), strict=True):
                        ref[i] = part
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
                weights = torch.cat(ws)
                loss, ls = clipped_loss(
                    logp,
                    torch.cat(olds),
                    torch.cat(advs),
                    torch.ones_like(logp),
                    g.clip_low,
                    g.clip_high,
                    weights,
                    lengths if g.ratio_level == "sequence" else None,
                )
                kl_value = 0.0
                if g.kl_coef > 0:
                    refs = torch.cat([r for r in (ref[i] for i in chunk) if r is not None])
                    kl = (kl_penalty(logp, refs, g.kl_estimator) * weights).sum()
                    loss = loss + g.kl_coef * kl
                    kl_value = float(kl)
                if g.entropy_coef > 0:
                    assert ent is not None
                    loss = loss - g.entropy_coef * (ent * weights).sum()
                loss.backward()
                if real:
                    diag = ent is not None and k < per_epoch
                    entropy = float(ent.detach().sum()) if diag and ent is not None else None
                    updates.append((role, ls, entropy, kl_value))
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
                if role_start is not None and last_of_role:
                    now = _local_grads(policy, p)
                    role_parts[role] = [a - z for a, z in zip(now, role_start, strict=True)]
                    role_start = None
            for part in fsdp.gather(updates):
                for role, ls, entropy, kl_value in part:
                    st.kl += kl_value
                    st.loss += ls.loss
                    st.tokens += ls.tokens
                    st.clipped_low += ls.clipped_low
                    st.clipped_high += ls.clipped_high
                    st.ratio_min = min(st.ratio_min, ls.ratio_min)
                    st.ratio_max = max(st.ratio_max, ls.ratio_max)
                    signals.add_update(role, ls.tokens, ls.clipped_low + ls.clipped_high, entropy)
            if k == 0:
                _merge_old(old, policy.device)
            if balance:
                for role, scale in balance_roles(policy, p, role_parts, weights_of_roles).items():
                    balance_scales[role].append(scale)
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
        if g.kl_coef > 0:
            m[f"policy/{p}/kl_ref"] = sum(s.kl for s in sts) / len(sts)
    for role, scales in balance_scales.items():
        m[f"role/{role}/balance_scale"] = sum(scales) / len(scales)
    m["time/diagnostics_s"] = diag_s
    if off_policy:
        for part in fsdp.gather(importance)[1:]:
            importance.tokens += part.tokens
            importance.total += part.total
            importance.truncated += part.truncated
        m.update(importance.metrics())
    return result
