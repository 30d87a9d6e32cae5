"""`MultiAdapterPolicy.state_dict`: the adapter's weights as PEFT names them, current after
every update and load, though it finds them only once."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import get_peft_model_state_dict

from services.learner.policy import MultiAdapterPolicy
from tests.support.batches import new_policy, spec


def peft_state(policy: MultiAdapterPolicy, name: str) -> dict[str, torch.Tensor]:
    return get_peft_model_state_dict(policy.model, adapter_name=name)  # type: ignore[no-any-return]


def test_state_dict_follows_updates_and_loads(model_dir: Path) -> None:
    policy = new_policy(model_dir, "shared", spec())
    first = policy.state_dict("shared")
    assert first.keys() == peft_state(policy, "shared").keys()
    with torch.no_grad():
        for p in policy.parameters("shared"):
            p.add_(0.5)  # an update in place, as AdamW's
    moved = policy.state_dict("shared")
    for k, v in peft_state(policy, "shared").items():
        torch.testing.assert_close(moved[k], v, rtol=0, atol=0)
        torch.testing.assert_close(moved[k], first[k] + 0.5, rtol=0, atol=1e-6)
    policy.load_state_dict("shared", first)
    for k, v in policy.state_dict("shared").items():
        torch.testing.assert_close(v, first[k], rtol=0, atol=0)
    moved["x"] = torch.zeros(())  # a copy: changing it changes nothing in the policy
    assert "x" not in policy.state_dict("shared")
