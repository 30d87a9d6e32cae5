from __future__ import annotations

import pytest
from pydantic import ValidationError

from marl.spec.code_refs import CodePolicy
from marl.spec.run import RunSpec, SpecError, apply_overrides, load_spec_text, parse_spec
from marl.workflows import policy_of_role, registry
from marl.workflows.routing import adapter_versions_in_flight


def test_defaults_are_the_papers() -> None:
    s = RunSpec()
    assert (s.optim.lr, s.optim.warmup_steps, s.optim.grad_clip) == (2e-5, 15, 1.0)
    assert (s.grpo.clip_low, s.grpo.clip_high, s.grpo.group_size, s.grpo.epochs) == (
        0.2,
        0.28,
        8,
        1,
    )
    assert (s.lora.rank, s.lora.alpha, s.lora.dropout, s.lora.target_modules) == (
        64,
        32,
        0.0,
        "all-linear",
    )
    assert (s.train.problems_per_step, s.train.val_interval, s.train.checkpoint_interval) == (
        64,
        10,
        5,
    )
    assert s.sampling.temperature == 0.7
    assert (
        s.caps.eval_opt_rounds_math,
        s.caps.eval_opt_rounds_code,
        s.caps.voting_candidates,
        s.caps.orch_workers,
    ) == (3, 2, 3, 3)


def test_overrides_are_dotted_and_typed() -> None:
    data = apply_overrides(
        {"optim": {"lr": 1.0}}, ["optim.lr=1e-3", "policy=isolated", "train.steps=7"]
    )
    spec = parse_spec(data)
    assert spec.optim.lr == 1e-3 and spec.policy == "isolated" and spec.train.steps == 7


def test_unknown_key_is_named() -> None:
    with pytest.raises(SpecError, match=r"unknown field `optim.learning_rate`"):
        load_spec_text("optim:\n  learning_rate: 0.1\n")


def test_bad_value_is_named() -> None:
    with pytest.raises(SpecError, match=r"field `grpo.group_size`.*greater than or equal to 2"):
        load_spec_text("grpo: {group_size: 1}")
    with pytest.raises(SpecError, match=r"field `workflow`"):
        load_spec_text("workflow: 'my debate'")
    # a plain name may be an installed workflow's: the services decide (marl/spec/code_refs.py)
    with pytest.raises(SpecError, match=r"field `workflow`: 'debate' is neither a built-in"):
        registry.check(load_spec_text("workflow: debate").workflow, CodePolicy())


def test_malformed_override() -> None:
    with pytest.raises(SpecError, match="key=value"):
        apply_overrides({}, ["policy"])


def test_adapter_versions_in_flight_size_a_vllm_replicas_lora_slots() -> None:
    def versions(**fields: object) -> int:
        return adapter_versions_in_flight(RunSpec.model_validate(fields))

    assert versions(workflow="orch_workers", policy="shared") == 1
    assert versions(workflow="orch_workers", policy="isolated") == 3
    assert versions(workflow="orch_workers", policy="isolated", train={"max_staleness": 2}) == 9
    assert versions(workflow="voting", policy_groups={"generator": "a", "aggregator": "a"},
                    train={"max_staleness": 1}) == 2
    with pytest.raises(ValidationError, match="less than or equal to 63"):
        RunSpec.model_validate({"train": {"max_staleness": 64}})


def test_policy_routing() -> None:
    assert policy_of_role(RunSpec(workflow="voting", policy="shared")) == {
        "generator": "shared",
        "aggregator": "shared",
    }
    assert policy_of_role(RunSpec(workflow="voting", policy="isolated")) == {
        "generator": "generator",
        "aggregator": "aggregator",
    }
    assert policy_of_role(
        RunSpec(workflow="voting", policy_groups={"generator": "a", "aggregator": "a"})
    ) == {"generator": "a", "aggregator": "a"}
    with pytest.raises(SpecError, match="missing roles"):
        policy_of_role(RunSpec(workflow="voting", policy_groups={"generator": "a"}))
