"""The learning rate each training step gets (Table 7: AdamW 2e-5, 15 warmup steps, cosine),
by hand: warmup counts the step it trains, (s + 1) / 15, and the cosine falls from the
peak at step 15 to 0 at the run's last step."""

from __future__ import annotations

import math

import pytest
import torch

from marl.spec.run import OptimSpec
from services.learner.policy import lr_lambda


def test_warmup_then_cosine_at_the_papers_settings() -> None:
    factor = lr_lambda(OptimSpec(lr=2e-5, warmup_steps=15, schedule="cosine"), 100)
    assert factor(0) == pytest.approx(1 / 15, abs=1e-15)
    assert factor(7) == pytest.approx(8 / 15, abs=1e-15)
    assert factor(14) == pytest.approx(1.0, abs=1e-15)
    assert factor(15) == pytest.approx(1.0, abs=1e-15)
    # step 99 of 100: cosine progress 84/85
    assert factor(99) == pytest.approx(0.5 * (1 + math.cos(math.pi * 84 / 85)), abs=1e-15)
    assert 2e-5 * factor(99) == pytest.approx(6.829e-09, rel=1e-3)


def test_constant_schedule_and_no_warmup() -> None:
    constant = lr_lambda(OptimSpec(lr=1e-3, warmup_steps=4, schedule="constant"), 50)
    assert [constant(s) for s in (0, 1, 3, 4, 49)] == pytest.approx([0.25, 0.5, 1, 1, 1])
    flat = lr_lambda(OptimSpec(lr=1e-3, warmup_steps=0, schedule="constant"), 50)
    assert flat(0) == flat(49) == 1.0


def test_the_optimizer_steps_through_those_rates() -> None:
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=2e-5)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lr_lambda(OptimSpec(lr=2e-5, warmup_steps=15, schedule="cosine"), 100)
    )
    rates = []
    for _ in range(16):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert rates[0] == pytest.approx(2e-5 / 15, rel=1e-12)
    assert rates[14] == rates[15] == pytest.approx(2e-5, rel=1e-12)
