"""The tasks the learner enqueues carry every spec setting a worker needs."""

from __future__ import annotations

from marl.config import parse_spec
from marl.data.problem import Problem
from marl.rollout import AdapterRef
from services.learner.episodes import Episodes


async def _no_cancel() -> None:
    return None


def test_learner_tasks_carry_the_chat_template_settings() -> None:
    spec = parse_spec({"model": {"chat_template_kwargs": {"enable_thinking": False}},
                       "sampling": {"temperature": 0.9, "val_temperature": 0.0}, "seed": 7})
    adapters = {"generator": AdapterRef("run/shared", 3), "aggregator": AdapterRef("run/shared", 3)}
    episodes = Episodes("run", spec, None, "learner-0", lambda: adapters, _no_cancel)  # type: ignore[arg-type]
    problem = Problem(id="p1", prompt="What is 1+1?", answer="2")
    train = episodes.make_task(problem, 4, "train", 2)
    val = episodes.make_task(problem, 4, "val", 0)
    assert train.chat_template_kwargs == {"enable_thinking": False}
    assert train.chat_template == spec.model.chat_template
    assert (train.temperature, val.temperature) == (0.9, 0.0)
    assert train.adapters == adapters and train.seed == 7 and train.sample == 2
