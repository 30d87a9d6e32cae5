"""Tasks and rollouts written straight from their dataclasses (`to_json`, `canonical`)
read back as the same JSON as their `to_dict()`: the bytes a task is signed over and a
rollout is streamed as do not depend on which of the two wrote them."""

from __future__ import annotations

import json

import pytest

from marl.problem import Problem
from marl.rollout import AdapterRef, Rollout, Task, Turn, json_fields, to_json
from marl.runtime.task_signing import TaskSigner, canonical
from tests.support.tasks import a_task


def a_full_task() -> Task:
    task = a_task()
    task.problem = Problem(
        id="p-ü", prompt="q \"quoted\"\n", answer="1", task="code",
        tests=[{"input": "1 2", "output": ["3", 4.5]}], messages=[{"role": "user", "content": "x"}],
        extra_info={"nested": {"k": (1, 2)}, "none": None},
    )
    task.adapters["judge"] = AdapterRef("run-1/judge", 7)
    task.judge = {"model": "m", "temperature": 0.0}
    task.workflow_args = {"rounds": 3, "names": ["a", "b"], "weights": {"x": 1.5}}
    return task


def a_full_rollout() -> Rollout:
    turn = Turn("generator", 0, [1, 2, 3], [4, 5], [-0.5, -1e-9], "stop",
                AdapterRef("run-1/generator", 3), "tëxt", tool_calls=1)
    return Rollout("t", "run-1", 3, "train", "p", 2, [turn, turn], "final", 0.25,
                   facts={"any_format_correct": 1.0}, role_rewards={"generator": -1.0},
                   judge_turns=[turn], error=None)


@pytest.mark.parametrize("value", [a_full_task(), a_full_rollout(), a_task()])
def test_written_from_the_dataclass_equal_the_dict_written(value: Task | Rollout) -> None:
    assert to_json(value) == json.dumps(value.to_dict())
    assert canonical(value) == canonical(value.to_dict())  # type: ignore[arg-type]


def test_a_signed_task_is_signed_over_the_same_bytes_either_way() -> None:
    signer = TaskSigner("token")
    task = a_full_task()
    assert signer.fields("marl:tasks", task) == signer.fields("marl:tasks", task.to_dict())
    assert canonical(Task.from_dict(json.loads(canonical(task)))) == canonical(task)


def test_what_is_not_json_data_is_refused_as_json_dumps_refuses_it() -> None:
    task = a_task()
    task.workflow_args = {"f": object()}
    with pytest.raises(TypeError, match="object is not JSON serializable"):
        to_json(task)
    with pytest.raises(TypeError):
        json_fields(Task)
