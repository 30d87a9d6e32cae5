"""The step path from the learner's run loop to the loss stays short (issue 81): at most 8
frames of marl code from `run_loop` to `grpo_loss`.

The step crosses a thread: the event loop's side is `run_loop` -> `train_run` (the run's
task) -> `RunExecutor.execute`, which hands the update to the torch thread with
`self.torch.run(policy.call, partial(grpo_step, ...), ...)` (`TorchThread.run` and `RunLane.run` return
a future, so no frame of theirs sits between; `_until_lost` only watches the lease beside
`execute`'s task). The torch thread's side is counted from a real step on the tiny model
run through that very hand-off (a `RunLane` on a `TorchThread`, `MultiAdapterPolicy.call`),
with a hook in `grpo_loss` that takes the thread's traceback: every frame of marl code
from the thread's entry to the loss is counted."""

from __future__ import annotations

import asyncio
import inspect
import traceback
from pathlib import Path

import pytest

from marl.runtime.torch_thread import TorchThread
from services.learner import trainer, update
from services.learner.run_lane import RunLane
from tests.support.batches import ROLES, new_policy, spec, voting_batch

ROOT = Path(__file__).resolve().parents[2]
EVENT_LOOP_SIDE = ["run_loop", "train_run", "execute"]


def marl_frames(stack: traceback.StackSummary) -> list[str]:
    return [f.name for f in stack if Path(f.filename).is_relative_to(ROOT / "marl")
            or Path(f.filename).is_relative_to(ROOT / "services")]


def test_execute_hands_the_step_straight_to_the_torch_thread() -> None:
    source = inspect.getsource(trainer.RunExecutor.execute)
    assert "self.torch.run(\n" in source and "policy.call, partial(grpo_step," in source


def test_the_step_path_is_at_most_eight_frames(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stacks: list[traceback.StackSummary] = []
    loss = update.grpo_loss

    def hooked(*args: object, **kwargs: object) -> update.LossOutputs:
        stacks.append(traceback.extract_stack()[:-1])  # without the hook's own frame
        return loss(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(update, "grpo_loss", hooked)
    s = spec(mini_batch_size=2)
    policy = new_policy(model_dir, "shared", s)
    batch = voting_batch()
    lane = RunLane(TorchThread("step-path"))

    async def hand_off() -> update.StepResult:
        return await lane.run(
            policy.call, update.grpo_step, batch, [r.problem_id for r in batch],
            ROLES["shared"], s,
        )

    try:
        result = asyncio.run(hand_off())
    finally:
        lane.thread.close()
    assert result.mini_batches and stacks
    thread_side = marl_frames(stacks[0]) + ["grpo_loss"]
    assert thread_side == ["_in_lane", "call", "grpo_step", "train_mini_batch", "grpo_loss"]
    assert len(EVENT_LOOP_SIDE + thread_side) <= 8


def test_the_run_executor_keeps_to_twelve_methods() -> None:
    """The executor runs the loop; records (`RunLog`), the stop, the top-up and the read
    ahead live beside it."""
    methods = [name for name, _ in inspect.getmembers(trainer.RunExecutor, inspect.isfunction)]
    assert len(methods) <= 12, methods
