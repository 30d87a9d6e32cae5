"""Mitigations of the paper's two mechanisms, against hand-worked numbers: `parallel_slots`
(pool, scale) for gradient_amplification, `role_balance` and the guard's `split` (adaptive
policy sharing) for sp_role_capture; and the specs they make no sense for, refused at
submit naming the field."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

import marl
from marl.diagnostics.alarms import Alarm
from marl.local.demo import DEMO_SPEC
from marl.spec.run import SpecError, apply_overrides, dump_spec, parse_spec
from marl.spec.services import LearnerConfig
from services.learner import checkpoint
from services.learner.advantages import group_advantages
from services.learner.batching import plan_mini_batches, pooled_units
from services.learner.guard import Guard, spare_adapters
from services.learner.policy import MultiAdapterPolicy
from services.learner.role_balance import balance_roles
from services.learner.sequences import build_sequences, turn_owners
from services.learner.server import validate_spec
from tests.support.batches import REWARDS, ROLES, spec, step, uneven_batch, voting_batch

LEARNER = LearnerConfig(model_roots=[str(marl.__path__[0])])
"""A learner whose operator allows the demo model's directory."""

CAPTURE = Alarm("sp_role_capture", "aggregator", 4, "terse rate 0.47 -> 0.11")
VOTING_SP = {"generator": "shared", "aggregator": "shared"}


def build(model_dir: Path, names: list[str], **grpo: Any) -> MultiAdapterPolicy:
    s = spec(**grpo)
    return MultiAdapterPolicy(str(model_dir), names, s.lora, s.optim, total_steps=10)


# --- parallel_slots ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "size", "each", "pool"),
    [
        # IP, 4 units a mini-batch: the generator's 24 turns are 8 units (one a rollout)
        ("isolated", 1, {"generator": 6, "aggregator": 2}, {"generator": 2, "aggregator": 2}),
        # SP, 8 units a mini-batch: 8 rollouts x (3 generators pooled + 1 aggregator) = 16
        ("shared", 2, {"shared": 4}, {"shared": 2}),
    ],
)
def test_pooled_slots_take_no_extra_optimizer_steps(
    model_dir: Path, mode: str, size: int, each: dict[str, int], pool: dict[str, int]
) -> None:
    for slots, want in (("each", each), ("pool", pool)):
        s = spec(mini_batch_size=size, parallel_slots=slots)
        policy = build(model_dir, sorted(set(ROLES[mode].values())))
        result = step(policy, voting_batch(), mode, s)
        got = {p: int(result.metrics[f"policy/{p}/optimizer_steps"]) for p in want}
        assert got == want, slots


def test_pooled_units_keep_a_rollouts_parallel_turns_together() -> None:
    rollouts = voting_batch()
    seqs = build_sequences(rollouts, [0.0] * len(rollouts), VOTING_SP)
    owners = turn_owners(rollouts)
    units = pooled_units(seqs, owners, ("generator",))
    assert len(set(units)) == 16  # per rollout: its generators' unit and its aggregator's
    plan = plan_mini_batches(seqs, 8, 1, random.Random(0), units)
    assert len(plan["shared"]) == 2 and sum(map(len, plan["shared"])) == 32
    for mb in plan["shared"]:
        assert len({units[i] for i in mb}) == 8  # 8 units, of 1 or 3 turns each
    for mb in plan["shared"]:
        for i in mb:
            if seqs[i].role == "generator":
                same = [j for j in range(len(seqs)) if owners[j] == owners[i]
                        and seqs[j].role == "generator"]
                assert set(same) <= set(mb)


def advantages_of_rewards() -> tuple[list[float], list[int]]:
    adv = group_advantages(
        [r for rs in REWARDS.values() for r in rs], [p for p, rs in REWARDS.items() for _ in rs]
    )
    return adv, [k for _ in REWARDS for k in range(4)]


def test_scaled_slots_weigh_each_rollouts_generators_as_one_by_hand(model_dir: Path) -> None:
    """uneven_batch: rollout k has n = k % 3 + 1 generator turns of 3 tokens and an
    aggregator turn of 2 + k. On-policy, one mini-batch, token_mean: loss = -Σ w·A with
    w = 1/T per token and each generator token's weight times 1/n. SP: T = 70 tokens, a
    rollout weighs n·3/n + 2 + k = 5 + k. IP's generator adapter: T = 42, a rollout 3."""
    adv, ks = advantages_of_rewards()
    s = spec(mini_batch_size=16, loss_agg="token_mean", parallel_slots="scale")
    sp = step(build(model_dir, ["shared"]), uneven_batch(), "shared", s).metrics
    want = -sum(a * (5 + k) for a, k in zip(adv, ks, strict=True)) / 70
    assert sp["policy/shared/loss"] == pytest.approx(want, abs=1e-6)
    ip = step(build(model_dir, ["aggregator", "generator"]), uneven_batch(), "isolated", s).metrics
    assert ip["policy/generator/loss"] == pytest.approx(-sum(a * 3 for a in adv) / 42, abs=1e-6)
    # without scaling a rollout weighs its 3n generator tokens
    plain = spec(mini_batch_size=16, loss_agg="token_mean")
    each = step(build(model_dir, ["shared"]), uneven_batch(), "shared", plain).metrics
    tokens = [3 * (k % 3 + 1) + 2 + k for k in ks]
    assert each["policy/shared/loss"] == pytest.approx(
        -sum(a * t for a, t in zip(adv, tokens, strict=True)) / 70, abs=1e-6
    )


# --- role_balance --------------------------------------------------------------------------


class TwoParams:
    def __init__(self) -> None:
        self.params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))]

    def parameters(self, _: str) -> list[torch.nn.Parameter]:
        return self.params


def test_role_balance_by_hand() -> None:
    """g_a = ([3, 0], [4]) (norm 5), g_b = ([0, 1], [0]) (norm 1), total mass 6. Equal
    weights: c_a = 0.5 · 6 / 5 = 0.6, c_b = 0.5 · 6 / 1 = 3; weights 2 : 1: c_a = 2/3 · 6 / 5
    = 0.8, c_b = 1/3 · 6 = 2."""
    parts = {
        "a": [torch.tensor([3.0, 0.0]), torch.tensor([4.0])],
        "b": [torch.tensor([0.0, 1.0]), torch.tensor([0.0])],
    }
    policy = TwoParams()
    scale = balance_roles(policy, "p", parts, {})  # type: ignore[arg-type]
    assert scale == pytest.approx({"a": 0.6, "b": 3.0})
    grads = [x.grad for x in policy.params]
    assert grads[0] is not None and grads[1] is not None
    assert grads[0].tolist() == pytest.approx([1.8, 3.0])
    assert grads[1].tolist() == pytest.approx([2.4])
    scale = balance_roles(policy, "p", parts, {"a": 2.0})  # type: ignore[arg-type]
    assert scale == pytest.approx({"a": 0.8, "b": 2.0})
    assert policy.params[0].grad.tolist() == pytest.approx([2.4, 2.0])  # type: ignore[union-attr]
    # one role with a gradient: nothing to balance
    idle = {"a": parts["a"], "b": [torch.zeros(2), torch.zeros(1)]}
    assert balance_roles(policy, "p", idle, {}) == {}  # type: ignore[arg-type]


@pytest.mark.parametrize("weights", [None, {"generator": 3.0, "aggregator": 1.0}])
def test_role_balance_in_the_step_gives_each_role_its_weights_share(
    model_dir: Path, weights: dict[str, float] | None
) -> None:
    """One mini-batch: each role's measured gradient norm (role/<r>/grad_norm) times its
    scale is its share of the balanced gradient's mass."""
    grpo: dict[str, Any] = {"mini_batch_size": 16, "role_balance": "equal"}
    if weights:
        grpo = {**grpo, "role_balance": "weights", "role_weights": weights}
    s = spec(**grpo)
    m = step(build(model_dir, ["shared"]), voting_batch(), "shared", s).metrics
    mass = {r: m[f"role/{r}/grad_norm"] * m[f"role/{r}/balance_scale"]
            for r in ("generator", "aggregator")}
    w = weights or {"generator": 1.0, "aggregator": 1.0}
    assert mass["generator"] / mass["aggregator"] == pytest.approx(
        w["generator"] / w["aggregator"], rel=1e-5
    )
    assert sum(mass.values()) == pytest.approx(
        m["role/generator/grad_norm"] + m["role/aggregator/grad_norm"], rel=1e-5
    )
    plain = step(build(model_dir, ["shared"]), voting_batch(), "shared", spec(mini_batch_size=16))
    assert plain.metrics["policy/shared/grad_norm"] != pytest.approx(m["policy/shared/grad_norm"])


# --- adaptive policy sharing: split --------------------------------------------------------


def split_spec(**over: Any) -> Any:
    base = spec().model_dump(mode="json")
    base["guard"] = {"on_alarm": {"sp_role_capture": "split"}}
    base.update(over)
    return parse_spec(base)


def test_spares_one_per_role_on_a_shared_adapter_named_clear_of_the_others() -> None:
    assert spare_adapters(split_spec(), VOTING_SP) == {
        "aggregator": "aggregator", "generator": "generator"
    }
    assert spare_adapters(spec(), VOTING_SP) == {}
    groups = {"orchestrator": "worker", "worker": "worker", "synthesizer": "synthesizer"}
    assert spare_adapters(split_spec(), groups) == {
        "orchestrator": "orchestrator", "worker": "worker-own"
    }


def test_decide_split_for_capture_and_stop_still_wins() -> None:
    s = split_spec(guard={"on_alarm": {"sp_role_capture": "split", "accuracy_cliff": "stop"}})
    g = Guard(s, spares=spare_adapters(s, VOTING_SP))
    action = g.decide([CAPTURE])
    assert action is not None and (action.kind, action.why) == (
        "split", "guard.on_alarm.sp_role_capture=split"
    )
    cliff = Alarm("accuracy_cliff", "all", 4, "down 0.2")
    stop = g.decide([CAPTURE, cliff])
    assert stop is not None and stop.kind == "stop"
    assert Guard(s).decide([CAPTURE]) is None  # no spare for the role: it warns


def test_spares_leave_the_shared_adapter_as_it_was(model_dir: Path) -> None:
    alone = build(model_dir, ["shared"])
    spared = build(model_dir, ["shared", "aggregator", "generator"])
    for k, v in alone.state_dict("shared").items():
        assert torch.equal(v, spared.state_dict("shared")[k]), k


def test_split_copies_weights_optimizer_and_schedule_then_trains_apart(
    model_dir: Path, tmp_path: Path
) -> None:
    s = split_spec()
    roles = dict(VOTING_SP)
    policy = build(model_dir, ["shared", "aggregator", "generator"])
    step(policy, voting_batch(0), "shared", s)
    policy.end_step()
    g = Guard(s, spares=spare_adapters(s, roles))
    said = g.split(policy, roles, "aggregator")
    assert said == "role aggregator on adapter aggregator, a copy of shared (optimizer state copied)"
    assert roles == {"generator": "shared", "aggregator": "aggregator"}
    for k, v in policy.state_dict("shared").items():
        assert torch.equal(v, policy.state_dict("aggregator")[k]), k
    src, dst = policy.optimizer_state("shared"), policy.optimizer_state("aggregator")
    assert src["state"].keys() == dst["state"].keys() and src["state"]
    for i, per in src["state"].items():
        for key, value in per.items():
            assert torch.equal(value, dst["state"][i][key]), (i, key)
    assert policy.schedulers["aggregator"].last_epoch == policy.schedulers["shared"].last_epoch
    assert g.split(policy, roles, "generator") is None  # alone on `shared` now

    before = {p: {k: v.clone() for k, v in policy.state_dict(p).items()} for p in policy.policies}
    result = grpo_with(policy, roles, s)
    assert result.metrics["policy/shared/optimizer_steps"] >= 1
    assert result.metrics["policy/aggregator/optimizer_steps"] >= 1
    for p, moved in (("shared", True), ("aggregator", True), ("generator", False)):
        changed = any(not torch.equal(v, policy.state_dict(p)[k]) for k, v in before[p].items())
        assert changed == moved, p

    # the checkpoint keeps the routed adapters and the routing, and loads back as it was
    ckpt = checkpoint.save(tmp_path, 2, policy, {"data_position": 0, "routing": roles})
    assert sorted(d.name for d in (ckpt / "adapters").iterdir()) == ["aggregator", "shared"]
    state = json.loads((ckpt / "state.json").read_text())
    assert state["routing"] == roles and state["adapters"] == ["aggregator", "shared"]
    fresh = build(model_dir, ["shared", "aggregator", "generator"])
    assert checkpoint.load(ckpt, fresh)["routing"] == roles
    for p in ("shared", "aggregator"):
        for k, v in policy.state_dict(p).items():
            assert torch.equal(v, fresh.state_dict(p)[k]), (p, k)


def grpo_with(policy: MultiAdapterPolicy, roles: dict[str, str], s: Any) -> Any:
    from services.learner.update import grpo_step

    rollouts = voting_batch(1)
    return grpo_step(policy, rollouts, [r.problem_id for r in rollouts], roles, s)


# --- specs they make no sense for ----------------------------------------------------------

MODEL = str(Path(marl.__file__).parent / "assets" / "demo-model")


def spec_yaml(*overrides: str) -> str:
    parsed = parse_spec(apply_overrides(DEMO_SPEC, list(overrides)))
    parsed.model.path = MODEL
    return dump_spec(parsed)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["policy=isolated", "guard.on_alarm.sp_role_capture=split"],
         "guard.on_alarm.sp_role_capture"),
        (["guard.on_alarm.gradient_amplification=split"], "guard.on_alarm"),
        (["workflow=single", "grpo.role_balance=equal"], "grpo.role_balance"),
        (["policy=isolated", "grpo.role_balance=equal"], "grpo.role_balance"),
        (["grpo.role_balance=weights", "grpo.role_weights={critic: 2}"], "grpo.role_weights"),
        (["grpo.role_weights={generator: 2}"], "grpo"),  # weights without role_balance
        (["workflow=single", "grpo.parallel_slots=pool"], "grpo.parallel_slots"),
        (["workflow=eval_opt", "grpo.parallel_slots=scale"], "grpo.parallel_slots"),
        (["workflow=single", "grpo.advantage_norm=role"], "grpo.advantage_norm"),
        (["grpo.overlong=8"], "grpo.overlong"),  # the demo's cap is 8 tokens
        (["train.val_pass_at=[2]", "sampling.val_temperature=0"], "train.val_pass_at"),  # greedy
    ],
)
def test_options_that_make_no_sense_are_refused_naming_the_field(
    overrides: list[str], field: str
) -> None:
    with pytest.raises(SpecError, match=f"field `{field}`"):
        validate_spec(spec_yaml(*overrides), LEARNER)


def test_options_that_fit_pass() -> None:
    validate_spec(spec_yaml(
        "guard.on_alarm.sp_role_capture=split",
        "grpo.role_balance=weights",
        "grpo.role_weights={aggregator: 2}",
        "grpo.parallel_slots=pool",
        "grpo.advantage_norm=role",
        "grpo.overlong=4",
        "grpo.kl_coef=0.01",
        "grpo.ratio_level=sequence",
        "grpo.baseline=leave_one_out",
        "grpo.dynamic_sampling=true",
        "train.val_pass_at=[1,4]",
        "sampling.val_temperature=0.7",
    ), LEARNER)
    validate_spec(spec_yaml("policy=isolated", "grpo.parallel_slots=scale"), LEARNER)


def test_report_marks_the_split_on_its_plots() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from marl.monitor.report import _mark_splits

    fig, ax = plt.subplots()
    ax.plot([0, 1, 2, 3], [0.1, 0.2, 0.3, 0.2])
    _mark_splits(ax, [
        {"step": 1, "guard": "rollback: x"},
        {"step": 2, "guard": "split: sp_role_capture[aggregator]@2: terse rate -> ...",
         "routing": "aggregator=aggregator,generator=shared"},
    ])
    assert [line.get_xdata()[0] for line in ax.lines[1:]] == [2]  # type: ignore[index]
    assert [t.get_text() for t in ax.texts] == ["split\naggregator=aggregator,generator=shared"]
    plt.close(fig)
