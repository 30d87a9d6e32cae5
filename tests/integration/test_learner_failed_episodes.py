"""Failed episodes in a real run are left out of their groups and of the loss.

Every service is a real process on a real Redis. The run's prompt cap
(`caps.prompt_tokens_math`) sits between the shortest and the longest Voting
aggregator prompt, so an episode whose three candidates together ran long fails
(the worker returns it with `error` set, no turns), and the others do not: a real
mix of failed and good episodes in one step. The step's every rollout is logged;
replaying them through `grpo_step` on a fresh policy built as the learner builds
it (same seed, version 0) gives the learner's logged loss whether or not the
failed rollouts are handed in, and a different loss if they had been scored 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from grpo_replay import replay_shared_loss
from transformers import AutoTokenizer

from marl.data import load_problems
from marl.local.launcher import Cluster
from marl.rollout import Rollout
from marl.spec.run import parse_spec
from marl.workflows import prompts
from services.learner.advantages import good_rollouts, group_advantages
from services.learner.sampler import DataSampler
from services.learner.trainer import FAILED_STEPS_LIMIT
from tests.support.runs import submit, wait_end

pytestmark = [pytest.mark.timeout(600), pytest.mark.cluster(model_fixture="tiny_model_dir", sandbox_replicas=0)]

PROBLEMS, GROUP, MAX_TOKENS = 4, 4, 6


def base_spec(model_dir: Path, out: Path) -> dict:
    return {
        "name": "it-failed",
        "workflow": "voting",
        "policy": "shared",
        "seed": 3,
        "out_dir": str(out),
        "model": {"path": str(model_dir)},
        "lora": {"rank": 4, "alpha": 8},
        "optim": {"lr": 1e-2, "warmup_steps": 0},
        "grpo": {"group_size": GROUP, "mini_batch_size": PROBLEMS},
        "train": {
            "steps": 1,
            "problems_per_step": PROBLEMS,
            "val_interval": 1,
            "val_problems": 2,
            "checkpoint_interval": 1,
            "rollouts_logged": PROBLEMS * GROUP,
            "step_timeout_s": 300,
        },
        "sampling": {"temperature": 2.0, "max_tokens": MAX_TOKENS},
        "data": {"train": "arithmetic", "val": "arithmetic"},
    }


def aggregator_cap(model_dir: Path, raw: dict) -> int:
    """The step's aggregator prompt with empty candidates plus 14 candidate tokens: under
    this seed the three candidates together take 9-17 tokens (the demo tokenizer
    re-encodes decoded text), so about a third of the episodes fail."""
    spec = parse_spec(raw)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    problems = DataSampler(load_problems(spec.data, "train", spec.seed), spec.seed).next(PROBLEMS)
    def length(messages: list[dict[str, str]]) -> int:  # as the worker renders a prompt
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return len(tok.encode(str(text), add_special_tokens=False))

    empty = max(length(prompts.selector(p, ["", "", ""])) for p in problems)
    return empty + 14


def test_failed_episodes_leave_their_groups_in_a_real_run(
    tiny_model_dir: Path, tmp_path: Path, cluster: Cluster
) -> None:
    out = tmp_path / "run"
    raw = base_spec(tiny_model_dir, out)
    raw["caps"] = {"prompt_tokens_math": aggregator_cap(tiny_model_dir, raw)}
    run = wait_end(cluster, submit(cluster, raw))
    assert run.state == "SUCCEEDED", run.error

    row = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1]
    lines = (out / "rollouts" / "step_000001.jsonl").read_text().splitlines()
    rollouts = [Rollout.from_dict(json.loads(line)) for line in lines]
    assert len(rollouts) == PROBLEMS * GROUP
    failed = [r for r in rollouts if r.error is not None]
    lengths = [sum(len(t.completion_ids) for t in r.turns[:3]) for r in rollouts if r.turns]
    assert failed, f"no episode failed; candidates' lengths {lengths}"
    assert all("prompt cap" in str(r.error) and not r.turns for r in failed)
    assert row["train/episode_errors"] == len(failed)

    groups = [r.problem_id for r in rollouts]
    keep, dropped = good_rollouts([r.error is not None for r in rollouts], groups)
    assert keep, f"every group was dropped: {[r.error for r in failed]}"
    assert row["train/groups_dropped"] == dropped
    outcome = {g: [(r.reward, r.error is not None) for r in rollouts if r.problem_id == g]
               for g in dict.fromkeys(groups)}
    partial = {groups[i] for i in keep} & {r.problem_id for r in failed}
    assert partial, f"no kept group lost a rollout: {outcome}"
    # four role turns per good rollout kept: nothing of a failed episode is trained
    assert row["train/sequences"] == sum(
        len([t for t in rollouts[i].turns if t.completion_ids]) for i in keep
    )

    # the good rollouts train exactly as if the failed ones had never been sampled
    good = [rollouts[i] for i in keep]
    logged = row["policy/shared/loss"]
    assert replay_shared_loss(tiny_model_dir, raw, rollouts) == pytest.approx(logged, rel=1e-4, abs=1e-7)
    assert replay_shared_loss(tiny_model_dir, raw, good) == pytest.approx(logged, rel=1e-4, abs=1e-7)

    # scored 0 instead, the failed ones would have shifted their groups' advantages
    as_zero = [
        Rollout.from_dict({**r.to_dict(), "error": None, "reward": 0.0})
        if r.error is not None
        else r
        for r in rollouts
    ]
    all_groups = [r.problem_id for r in as_zero]
    with_zeros = group_advantages([r.reward for r in as_zero], all_groups)
    without = group_advantages([r.reward for r in good], [r.problem_id for r in good])
    shifted = [with_zeros[i] for i in keep]
    assert any(abs(a - b) > 1e-6 for a, b in zip(shifted, without, strict=True)), outcome
    assert replay_shared_loss(tiny_model_dir, raw, as_zero) != pytest.approx(logged, rel=1e-3)


def test_a_run_whose_every_episode_fails_fails_with_their_error(
    tiny_model_dir: Path, tmp_path: Path, cluster: Cluster
) -> None:
    """A prompt cap below every prompt: each step trains nothing, and after
    FAILED_STEPS_LIMIT such steps in a row the run fails naming the episodes' error."""
    out = tmp_path / "run"
    raw = base_spec(tiny_model_dir, out)
    raw["caps"] = {"prompt_tokens_math": 8}
    raw["train"].update(steps=6, val_interval=6, checkpoint_interval=6)
    run = wait_end(cluster, submit(cluster, raw))
    assert run.state == "FAILED"
    assert run.error.startswith(f"every episode of steps 1-{FAILED_STEPS_LIMIT} failed"), run.error
    assert "prompt cap" in run.error
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in trained] == list(range(1, FAILED_STEPS_LIMIT))
    assert all(r["train/episode_errors"] == PROBLEMS * GROUP for r in trained)
