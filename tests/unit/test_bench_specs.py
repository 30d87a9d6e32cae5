"""The run specs the benches submit (bench/e2e.py's `spec`, shared by vs_trl.py and
policy_process.py): each bench's own default arguments give a spec the learner accepts."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import e2e
import host
import inference
import pytest
import vs_trl
from models import bench_model

from marl.models.demo import demo_model_dir
from marl.spec.run import parse_spec


@pytest.mark.parametrize("model", ["demo", "smollm2"])
def test_e2e_spec_takes_each_models_defaults(
    model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "argv", ["e2e.py", "--model", model])
    args = e2e.parse_args()
    defaults = e2e.MODEL_DEFAULTS[model]
    assert (args.problems, args.group, args.max_tokens) == (
        defaults["problems"], defaults["group"], defaults["max_tokens"]
    )
    body = e2e.spec("voting", tmp_path / "out", args, 1, str(tmp_path / "model"))
    spec = parse_spec(body)
    assert spec.model.path == str(tmp_path / "model")
    assert spec.train.max_staleness == 1
    assert spec.train.problems_per_step == defaults["problems"]
    assert spec.lora.rank == defaults["rank"]


def test_an_explicit_argument_beats_the_models_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["e2e.py", "--model", "smollm2", "--problems", "2"])
    args = e2e.parse_args()
    assert args.problems == 2
    assert args.group == e2e.MODEL_DEFAULTS["smollm2"]["group"]


def test_vs_trl_builds_its_marl_run_from_e2es_spec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vs_trl's arguments name no model: the spec runs the demo model."""
    monkeypatch.setattr(sys, "argv", ["vs_trl.py"])
    args = vs_trl.parse_args()
    spec = parse_spec(e2e.spec("single", tmp_path / "out", args, args.max_staleness))
    assert spec.model.path == str(demo_model_dir())
    assert spec.workflow == "single"
    assert spec.sampling.max_tokens == args.max_tokens


def test_vs_trl_trains_both_in_marls_precision(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TRL's GRPOConfig turns bf16 autocast on by default; marl trains in float32."""
    monkeypatch.setattr(sys, "argv", ["vs_trl.py"])
    args = vs_trl.parse_args()
    spec = parse_spec(e2e.spec("single", tmp_path / "out", args, args.max_staleness))
    settings = vs_trl.trl_settings(args, tmp_path / "trl")
    assert spec.model.dtype == "float32"
    assert settings["bf16"] is False and settings["fp16"] is False
    assert settings["max_completion_length"] == spec.sampling.max_tokens


def test_the_demo_model_needs_no_import(tmp_path: Path) -> None:
    assert bench_model("demo", tmp_path) == str(demo_model_dir())
    assert not any(tmp_path.iterdir())


def test_e2e_refuses_too_few_steps_to_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["e2e.py", "--steps", str(e2e.WARMUP_STEPS + 1)])
    with pytest.raises(SystemExit):
        e2e.parse_args()


CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 fma

processor\t: 1
model name\t: another CPU
flags\t\t: avx512f avx512_bf16
"""


def test_the_host_line_names_the_first_cpu_and_its_matmul_flags() -> None:
    facts = host.host(CPUINFO)
    assert (facts["cpu"], facts["cpu_family"], facts["cpu_model"]) == ("AMD EPYC", "25", "1")
    assert facts["flags"] == ["avx2"]
    assert host.describe({**facts, "cores": 2}) == "host: AMD EPYC (family 25 model 1), 2 cores, avx2"
    assert host.describe({**facts, "cores": 2, "flags": []}).endswith(
        "2 cores, none of avx2, avx512f, avx512_bf16, amx_bf16"
    )


def test_e2e_refuses_no_inference_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["e2e.py", "--replicas", "0"])
    with pytest.raises(SystemExit):
        e2e.parse_args()


def test_the_sync_ceiling_keeps_the_flights_time_with_no_replica_generating() -> None:
    """1,000 tokens at the engine alone's 10,000 tok/s are 0.1 s; 0.025 s of the flight
    had no replica generating: the ratio can reach 0.1 / 0.125 and no more."""
    assert e2e.ceiling_at_engine_rate(1000, 10_000, 0.025) == pytest.approx(0.8)
    assert e2e.ceiling_at_engine_rate(1000, 10_000, 0.0) == pytest.approx(1.0)
    assert e2e.ceiling_at_engine_rate(648, 22_708, 0.043) == pytest.approx(0.3989, abs=1e-4)


def test_inference_ratios_pair_each_rounds_batches() -> None:
    """A slow stretch took round 2 whole and round 3's mixed batch only: the rounds' own
    ratios are 0.8, 0.8 and 0.5, their median 0.8. Each kind's median is round 3's (450
    and 900), so the medians' ratio would be that one uneven round's, 0.5."""
    mixed, base = [800.0, 400.0, 450.0], [1000.0, 500.0, 900.0]
    assert inference.paired_ratio(mixed, base) == pytest.approx(0.8)
    assert inference.paired_ratio([3.0, 1.0], [4.0, 4.0]) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        inference.paired_ratio([1.0], [1.0, 2.0])


def test_interleaved_reverses_the_order_every_other_round() -> None:
    ran: list[str] = []

    def run(kind: str, value: float) -> Callable[[], Awaitable[float]]:
        async def one() -> float:
            ran.append(kind)
            return value + len(ran)

        return one

    rates = asyncio.run(inference.interleaved(3, {"a": run("a", 0.0), "b": run("b", 10.0)}))
    assert ran == ["a", "b", "b", "a", "a", "b"]
    assert rates == {"a": [1.0, 4.0, 5.0], "b": [12.0, 13.0, 16.0]}
