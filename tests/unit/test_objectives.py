"""The objective options beyond the paper's GRPO (KL, entropy, GSPO, RLOO, Dr. MAS, DAPO's
dynamic sampling and overlong band, pass@k), each against hand-worked numbers, and the
golden step: at the defaults a fixed step's losses equal those recorded before any option
existed (commit b87627a's update, this host's float32 CPU arithmetic).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_grpo_minibatch import new_policy, spec, step, voting_batch

GOLDEN = {
    # two steps (voting_batch seeds 0 and 1) at mini_batch_size 2: 4 optimizer steps a step
    # under SP, the generator's 3 and the aggregator's 1 under IP; recorded before the options
    "shared": {
        "0:policy/shared/grad_norm": 1.5959631875157356,
        "0:policy/shared/loss": 0.022429296746850014,
        "0:policy/shared/update_chi2": 0.2455689113412518,
        "0:mb_losses": [
            -0.0792466327548027, 0.09426328539848328, 0.22888170182704926, -0.15418116748332977,
        ],
        "1:policy/shared/grad_norm": 0.14999710395932198,
        "1:policy/shared/loss": 0.03283654060214758,
        "1:policy/shared/update_chi2": 1.4435548325418495,
        "1:mb_losses": [
            0.15849332511425018, -0.4829325005412102, 0.06777268648147583, 0.3880126513540745,
        ],
        "param_abs_sum": {"shared": 18903.447265625},
    },
    "isolated": {
        "0:policy/aggregator/grad_norm": 0.6294695734977722,
        "0:policy/aggregator/loss": -7.450580596923828e-09,
        "0:policy/aggregator/update_chi2": 0.2934092194773257,
        "0:policy/generator/grad_norm": 3.066702499985695,
        "0:policy/generator/loss": 0.0634294052918752,
        "0:policy/generator/update_chi2": 0.15969545324333012,
        "0:mb_losses": [
            -7.450580596923828e-09, 0.1707528904080391, 0.006141699850559235,
            0.013393625617027283,
        ],
        "1:policy/aggregator/grad_norm": 4.617496013641357,
        "1:policy/aggregator/loss": 0.0,
        "1:policy/aggregator/update_chi2": 0.049955256399698555,
        "1:policy/generator/grad_norm": 1.8966252605120342,
        "1:policy/generator/loss": -0.0014544079701105754,
        "1:policy/generator/update_chi2": 0.13784926623338833,
        "1:mb_losses": [0.0, -0.1707528531551361, 0.429111123085022, -0.2627214938402176],
        "param_abs_sum": {"aggregator": 7258.8037109375, "generator": 16235.7236328125},
    },
}


@pytest.mark.parametrize("mode", ["shared", "isolated"])
def test_golden_step_at_the_defaults(model_dir: Path, mode: str) -> None:
    """Two fixed steps at the defaults give the losses, gradient norms and weights they gave
    before the options existed, to 1e-6 (the weights' sums relative: they are ~1e4)."""
    s = spec(mini_batch_size=2)
    policy = new_policy(model_dir, mode, s)
    got: dict[str, object] = {}
    for k in range(2):
        result = step(policy, voting_batch(seed=k), mode, s)
        for key, value in result.metrics.items():
            got[f"{k}:{key}"] = value
        got[f"{k}:mb_losses"] = [mb.loss for mb in result.mini_batches]
    got["param_abs_sum"] = {
        p: float(sum(t.abs().sum() for t in policy.state_dict(p).values()))
        for p in policy.policies
    }
    for key, want in GOLDEN[mode].items():
        if key == "param_abs_sum":
            assert got[key] == pytest.approx(want, rel=1e-6), key
        else:
            assert got[key] == pytest.approx(want, abs=1e-6), key
