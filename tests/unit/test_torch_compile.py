"""`grpo.torch_compile`: a compiled decoder trains as the eager one does (float rounding
apart), goes back to eager when the option is off, and is refused beside FSDP."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from marl.spec.run import SpecError, parse_spec
from services.learner.option_checks import spec_problems
from tests.support.batches import ROLES, new_policy, spec, step, voting_batch


def adapters(policy: object) -> torch.Tensor:
    params = policy.parameters("shared")  # type: ignore[attr-defined]
    return torch.cat([p.detach().flatten() for p in params])


def test_a_compiled_step_is_the_eager_step(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # inductor's code cache of its own: the kernel-set reruns (`make test-kernels`) would
    # otherwise build C++ generated for this CPU's vector ISA under ATEN_CPU_CAPABILITY's
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    s = spec(torch_compile=True)
    eager, compiled = new_policy(model_dir, "shared", spec()), new_policy(model_dir, "shared", s)
    rollouts = voting_batch()
    want = step(eager, rollouts, "shared", spec())
    got = step(compiled, rollouts, "shared", s)
    causal: Any = compiled.model.get_base_model()
    decoder = causal.get_decoder()
    assert "forward" in decoder.__dict__  # it did run compiled
    for key in ("policy/shared/loss", "role/generator/update_chi2", "role/aggregator/kl_base"):
        assert got.metrics[key] == pytest.approx(want.metrics[key], rel=1e-4, abs=1e-7), key
    # AdamW's first step moves each weight by lr · g / (|g| + eps): ±lr wherever |g| >> eps,
    # a fraction of it that float rounding sets where a gradient cancels to within a few eps;
    # a wrong backward moves weights the other way, 2 lr apart
    lr = s.optim.lr
    apart = (adapters(compiled) - adapters(eager)).abs()
    assert float((apart > 1e-3 * lr).float().mean()) < 1e-3
    assert float(apart.max()) < lr
    compiled.set_compiled(False)
    assert "forward" not in decoder.__dict__


def test_compiling_beside_fsdp_is_refused_naming_the_field() -> None:
    s = parse_spec({"grpo": {"torch_compile": True}, "learner": {"world_size": 2}})
    with pytest.raises(SpecError, match="grpo.torch_compile"):
        spec_problems(s, ROLES["shared"])
