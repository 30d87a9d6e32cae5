"""Role drift alarms on hand-made metric series: exact evidence, and series that must not fire."""

from __future__ import annotations

from typing import Any

import pytest

from marl.diagnostics.alarms import Alarm, AlarmWatch, check, scan
from marl.spec.run import AlarmSpec

SPEC = AlarmSpec()  # windows of 3, amplification 3x and 2x the others, χ² floor 0.02,
# length 2x, terse -30 % of its first value, entropy to 0.3x


def records(**columns: list[float | None]) -> list[dict[str, Any]]:
    """One record per step 1..n; a column maps `role/<role>/<signal>` with `__` for `/`."""
    n = max(len(v) for v in columns.values())
    out: list[dict[str, Any]] = []
    for i in range(n):
        rec: dict[str, Any] = {"step": i + 1}
        for name, values in columns.items():
            if i < len(values) and values[i] is not None:
                rec[name.replace("__", "/")] = values[i]
        out.append(rec)
    return out


def test_gradient_amplification_fires_on_the_role_that_climbs_alone() -> None:
    recs = records(
        role__generator__chi2_token=[0.05, 0.05, 0.05, 0.2, 0.3, 0.4],
        role__aggregator__chi2_token=[0.05, 0.05, 0.05, 0.05, 0.06, 0.07],
    )
    # the generator is Voting's parallel role; naming only the aggregator keeps it quiet
    assert scan(recs, SPEC, shared=False, parallel=("aggregator",)) == []
    # the mean of the last 3 values over the mean of the first 3: 0.3 / 0.05 and 0.06 / 0.05
    assert scan(recs, SPEC, shared=False, parallel=("generator",)) == [
        Alarm(
            "gradient_amplification",
            "generator",
            6,
            "chi2_token 6.00x its first value vs at most 1.20x for the other roles",
        )
    ]


def test_gradient_amplification_quiet_when_roles_rise_together_or_alone_or_early() -> None:
    together = records(
        role__generator__chi2_token=[1.0, 1.0, 1.0, 2.0, 4.0, 6.0],
        role__aggregator__chi2_token=[1.0, 1.0, 1.0, 2.0, 3.0, 4.0],
    )
    assert scan(together, SPEC, shared=False) == []  # 4x < 2 x 3x
    one_role = records(role__generator__chi2_token=[1.0, 1.0, 1.0, 2.0, 9.0, 9.0])
    assert scan(one_role, SPEC, shared=False) == []  # nothing to compare with
    early = records(
        role__generator__chi2_token=[1.0, 1.0, 1.0, 9.0, 9.0],
        role__aggregator__chi2_token=[1.0, 1.0, 1.0, 1.0, 1.0],
    )
    assert scan(early, SPEC, shared=False) == []  # fewer than two windows of values
    just_below = records(
        role__generator__training_ppl=[2.0, 2.0, 2.0, 5.0, 6.0, 6.7],
        role__aggregator__training_ppl=[2.0, 2.0, 2.0, 2.0, 2.0, 2.0],
    )
    assert scan(just_below, SPEC, shared=False) == []  # 5.9 / 2 = 2.95x < 3x
    noise = records(
        role__generator__chi2_token=[0.001, 0.001, 0.001, 0.005, 0.01, 0.015],
        role__aggregator__chi2_token=[0.001, 0.001, 0.001, 0.001, 0.001, 0.001],
    )
    assert scan(noise, SPEC, shared=False) == []  # 10x of values under the 0.02 floor


def test_sp_role_capture_on_aggregator_length_moving_toward_the_generators() -> None:
    recs = records(
        role__aggregator__response_len_p50=[10, 12, 25],
        role__generator__response_len_p50=[100, 100, 100],
    )
    assert scan(recs, SPEC, shared=True) == [
        Alarm(
            "sp_role_capture",
            "aggregator",
            3,
            "median length 10 -> 25 tokens (2.50x), toward generator's 100",
        )
    ]


def test_length_growth_without_closing_a_gap_is_not_capture() -> None:
    longest_grows = records(
        role__aggregator__response_len_p50=[10, 10, 10],
        role__generator__response_len_p50=[100, 200, 300],
    )
    assert scan(longest_grows, SPEC, shared=True) == []
    both_grow = records(
        role__aggregator__response_len_p50=[10, 20, 25],
        role__generator__response_len_p50=[100, 150, 200],
    )
    assert scan(both_grow, SPEC, shared=True) == []  # gap 175 > first gap 90


def test_sp_role_capture_on_lost_terseness_and_code_fences() -> None:
    recs = records(
        sig__aggregator__terse_rate=[0.9, 0.8, 0.5],
        sig__evaluator__python_code_fence=[0.0, 0.1, 0.2, 0.35],
    )
    assert [str(a) for a in scan(recs, SPEC, shared=True)] == [
        "sp_role_capture[aggregator]@3: terse rate 0.90 -> 0.50",
        "sp_role_capture[evaluator]@4: code-fence rate 0.00 -> 0.35",
    ]
    quiet = records(
        sig__aggregator__terse_rate=[0.9, 0.8, 0.7, 0.95],
        sig__evaluator__python_code_fence=[0.1, 0.0, 0.3, 0.2],
    )
    assert scan(quiet, SPEC, shared=True) == []


def test_terseness_is_lost_as_a_fraction_of_where_it_started() -> None:
    """An aggregator that starts at 0.3125 terse can never lose 0.3 of it; losing 30 % of
    it (to 0.21875 or below) is capture."""
    low_start = records(sig__aggregator__terse_rate=[0.3125, 0.3125, 0.25, 0.1640625])
    assert [str(a) for a in scan(low_start, SPEC, shared=True)] == [
        "sp_role_capture[aggregator]@4: terse rate 0.31 -> 0.16",
    ]
    assert scan(records(sig__aggregator__terse_rate=[0.3125, 0.3, 0.25, 0.22]), SPEC,
                shared=True) == []
    plain = records(sig__aggregator__terse_rate=[1.0, 1.0, 0.93, 0.992])  # a plain Voting-SP run
    assert scan(plain, SPEC, shared=True) == []


def test_capture_needs_a_shared_adapter_and_gradient_share_alone_is_not_capture() -> None:
    shape = records(
        sig__aggregator__terse_rate=[0.9, 0.8, 0.5],
        role__aggregator__response_len_p50=[10, 12, 25],
        role__generator__response_len_p50=[100, 100, 100],
    )
    assert len(scan(shape, SPEC, shared=True)) == 2
    assert scan(shape, SPEC, shared=False) == []  # own adapters: nothing can capture a slot
    # a plain Voting-SP demo run: the generators' groups saturate, the aggregator's share rises
    share = records(
        role__generator__grad_share=[0.68, 0.41, 0.76, 0.53, 0.62, 0.48, 0.70, 0.16],
        role__aggregator__grad_share=[0.32, 0.59, 0.24, 0.47, 0.38, 0.52, 0.30, 0.84],
    )
    assert scan(share, SPEC, shared=True) == []


def test_entropy_collapse() -> None:
    recs = records(role__worker__entropy=[2.0, 2.0, 2.0, 0.8, 0.5, 0.2])
    assert [str(a) for a in scan(recs, SPEC, shared=False)] == [
        "entropy_collapse[worker]@6: token entropy 2.000 -> 0.500 (0.25x its first value)"
    ]
    sharpening = records(role__worker__entropy=[2.0, 2.0, 2.0, 1.2, 0.8, 0.7])  # 0.45x
    assert scan(sharpening, SPEC, shared=False) == []
    # one low step is noise, not collapse: the window's mean stays above 0.3x
    assert (
        scan(records(role__worker__entropy=[2.0, 2.0, 2.0, 2.0, 2.0, 0.1]), SPEC, shared=False)
        == []
    )


def test_accuracy_cliff_fires_once_at_onset_and_again_after_recovery() -> None:
    # validation every other step; training steps in between do not reset the state
    acc = [0.2, None, 0.6, None, 0.55, None, 0.45, None, 0.4, None, 0.62, None, 0.5]
    alarms = scan(records(val__accuracy=acc), SPEC, shared=False)
    assert [str(a) for a in alarms] == [
        "accuracy_cliff[all]@7: validation accuracy 0.450, down 0.150 from 0.600 at step 3",
        "accuracy_cliff[all]@13: validation accuracy 0.500, down 0.120 from 0.620 at step 11",
    ]
    assert scan(records(val__accuracy=[0.2, 0.6, 0.55, 0.51, 0.7]), SPEC, shared=False) == []


def test_thresholds_come_from_the_spec() -> None:
    recs = records(val__accuracy=[0.6, 0.55])
    assert scan(recs, SPEC, shared=False) == []
    strict = AlarmSpec(cliff_drop=0.05)
    assert [a.mechanism for a in scan(recs, strict, shared=False)] == ["accuracy_cliff"]


def test_check_reports_quiet_conditions_and_watch_follows_records() -> None:
    recs = records(role__generator__entropy=[1.0] * 6)
    assert check(recs, SPEC, shared=False) == {"entropy_collapse/generator": None}
    watch = AlarmWatch(SPEC, shared=False)
    series = [1.0, 1.0, 1.0, 0.2, 0.2, 0.2, 0.2]
    got = [watch.update(r) for r in records(role__generator__entropy=series)]
    assert [[a.step for a in step] for step in got] == [[], [], [], [], [], [6], []]


def test_gradient_amplification_names_only_parallel_roles_when_told() -> None:
    climbing, flat = [0.05, 0.05, 0.05, 0.2, 0.3, 0.4], [0.05] * 6
    recs = records(role__aggregator__chi2_token=climbing, role__generator__chi2_token=flat)
    assert [a.role for a in scan(recs, SPEC, shared=False)] == ["aggregator"]
    assert scan(recs, SPEC, shared=False, parallel=("generator",)) == []
    flipped = records(role__generator__chi2_token=climbing, role__aggregator__chi2_token=flat)
    assert [a.role for a in scan(flipped, SPEC, shared=False, parallel=("generator",))] == [
        "generator"
    ]


def test_sampler_mismatch_names_the_adapter_at_onset() -> None:
    # adapter "generator" stops following the learner from step 3 (a failed push: inference
    # keeps serving an older version, the gap grows); "aggregator" stays in sync
    recs = records(
        policy__generator__logprob_gap=[1e-6, 1e-6, 0.04, 0.12, 0.25, 0.31],
        policy__generator__logprob_kl=[0.0, 0.0, 0.001, 0.011, 0.052, 0.08],
        policy__aggregator__logprob_gap=[1e-6] * 6,
    )
    assert [str(a) for a in scan(recs, SPEC, shared=False)] == [
        "sampler_mismatch[generator]@4: sampling and learner log-probs differ by 0.120 per "
        "token (KL estimate 0.0110)"
    ]
    assert check(recs, SPEC, shared=False)["sampler_mismatch/aggregator"] is None
    loose = AlarmSpec(logprob_gap_max=0.3)
    assert [a.step for a in scan(recs, loose, shared=False)] == [6]


def test_gradient_amplification_is_an_isolated_policy_mechanism() -> None:
    """The IP signature (Voting's generator climbing alone) on an SP record set is not
    gradient_amplification: one adapter serves every role, so nothing is amplified apart."""
    ip_signature = records(
        role__generator__chi2_token=[0.05, 0.05, 0.05, 0.2, 0.3, 0.4],
        role__aggregator__chi2_token=[0.05, 0.05, 0.05, 0.05, 0.06, 0.07],
        role__generator__training_ppl=[2.0, 2.0, 2.0, 5.0, 7.0, 9.0],
        role__aggregator__training_ppl=[2.0] * 6,
    )
    assert [a.mechanism for a in scan(ip_signature, SPEC, shared=False, parallel=("generator",))] == [
        "gradient_amplification",
        "gradient_amplification",
    ]
    sp = scan(ip_signature, SPEC, shared=True, parallel=("generator",))
    assert [a for a in sp if a.mechanism == "gradient_amplification"] == []


def test_alarms_read_the_chi2_the_spec_names() -> None:
    recs = records(
        role__generator__update_chi2=[0.05, 0.05, 0.05, 0.2, 0.3, 0.4],
        role__aggregator__update_chi2=[0.05] * 6,
        role__generator__chi2_token=[1e-7] * 6,
        role__aggregator__chi2_token=[1e-7] * 6,
    )
    token = AlarmSpec(chi2_signal="chi2_token")
    assert scan(recs, token, shared=False, parallel=("generator",)) == []  # ρ ≈ 1: flat
    fired = ["gradient_amplification[generator]@6: update_chi2 6.00x its first value vs at "
             "most 1.00x for the other roles"]
    moved = AlarmSpec(chi2_signal="update_chi2")
    assert [str(a) for a in scan(recs, moved, shared=False, parallel=("generator",))] == fired
    # auto (the default): chi2_token within its noise floor, so update_chi2 is read
    assert SPEC.chi2_signal == "auto"
    assert [str(a) for a in scan(recs, SPEC, shared=False, parallel=("generator",))] == fired


@pytest.mark.parametrize(("token", "read"), [
    ([1e-7, -3e-8, 5e-7], "update_chi2"),  # float32 rounding, some of it negative
    ([1e-4, -1e-4, 0.0], "update_chi2"),  # the floor itself is still noise
    ([1e-7, 2e-3, 1e-7], "chi2_token"),  # one value out of the floor: a signal
    ([], "update_chi2"),  # never logged: nothing to read there
])
def test_auto_reads_chi2_token_only_above_its_noise_floor(token: list[float], read: str) -> None:
    from marl.diagnostics.alarms import chi2_series

    recs = records(policy__shared__chi2_token=token) if token else records(x=[1.0])
    assert chi2_series(recs, "auto", 1e-4) == read
    assert chi2_series(recs, "chi2_token", 1e-4) == "chi2_token"


def orch_workers_sp(worker_share: list[float], chi2: list[float]) -> list[dict[str, Any]]:
    """Orch-Workers-SP: 3 worker slots of 5 on the one shared adapter (Table 6, Fig. 6b);
    per-role shapes stay put, the adapter's global χ² climbs."""
    n = len(chi2)
    return records(
        policy__shared__chi2_token=chi2,
        policy__shared__training_ppl=[1.8] * n,
        role__worker__grad_share=worker_share,
        role__orchestrator__grad_share=[(1 - s) / 2 for s in worker_share],
        role__synthesizer__grad_share=[(1 - s) / 2 for s in worker_share],
        role__worker__chi2_token=chi2,
        role__orchestrator__chi2_token=chi2,
        role__synthesizer__chi2_token=chi2,
    )


def test_sp_role_capture_by_frequency_asymmetry_names_the_multi_slot_role() -> None:
    recs = orch_workers_sp([0.6] * 7, [0.04, 0.04, 0.04, 0.06, 0.1, 0.16, 0.2])
    # mean of the last 3 over the first 3: (0.1 + 0.16 + 0.2) / 3 / 0.04 = 3.83x at step 7;
    # step 6: (0.06 + 0.1 + 0.16) / 3 / 0.04 = 2.67x, below the 3x threshold
    assert [str(a) for a in scan(recs, SPEC, shared=True, parallel=("worker",))] == [
        "sp_role_capture[worker]@7: shared adapter shared's chi2_token 3.83x its first value "
        "while worker carries 0.60 of its gradient"
    ]
    # the same climb with the workers not dominating the gradient is not capture
    minor = orch_workers_sp([0.4] * 7, [0.04, 0.04, 0.04, 0.06, 0.1, 0.16, 0.2])
    assert scan(minor, SPEC, shared=True, parallel=("worker",)) == []
    # nor under Isolated-Policy, nor a flat adapter
    assert scan(recs, SPEC, shared=False, parallel=("worker",)) == []
    flat = orch_workers_sp([0.6] * 7, [0.04] * 7)
    assert scan(flat, SPEC, shared=True, parallel=("worker",)) == []
