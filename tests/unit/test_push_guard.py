"""A replica's push budget (pushes and declared bytes at once) and its fencing memory."""

from __future__ import annotations

import grpc
import pytest

from marl.runtime.fences import PushFences, StaleFence
from services.inference.push_guard import PushBudget, PushRefused


def test_the_budget_refuses_pushes_past_its_count_and_bytes_and_frees_them() -> None:
    budget = PushBudget(max_pushes=2, max_bytes=100)
    with budget.reserve("a/p@1", 60):
        with pytest.raises(PushRefused) as err:
            with budget.reserve("a/p@2", 41):
                pass
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "past 100 bytes" in err.value.message
        with budget.reserve("a/p@3", 40):
            with pytest.raises(PushRefused) as err:
                with budget.reserve("a/p@4", 0):
                    pass
            assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_concurrent_pushes" in err.value.message
    assert (budget.pushes, budget.bytes) == (0, 0)
    with pytest.raises(PushRefused) as err:
        with budget.reserve("a/p@5", 101):
            pass
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION  # it never fits


def test_a_budget_reserved_by_a_push_that_fails_is_freed() -> None:
    budget = PushBudget(max_pushes=1, max_bytes=100)
    with pytest.raises(ValueError), budget.reserve("a/p@1", 50):
        raise ValueError("the payload was not safetensors")
    assert (budget.pushes, budget.bytes) == (0, 0)


def test_fences_refuse_older_and_unissued_tokens() -> None:
    seen = PushFences()
    seen.check("a", 1, None)
    seen.check("a", 3, None)  # no Redis: the newest seen is the bar
    with pytest.raises(StaleFence, match="token 2 is stale"):
        seen.check("a", 2, None)
    seen.check("b", 0, None)  # another run's tokens are its own
    with pytest.raises(StaleFence, match="token 4 is stale"):
        seen.check("c", 4, 5)  # Redis knows a newer lease this replica never saw pushed
    with pytest.raises(StaleFence, match="never issued"):
        seen.check("c", 6, 5)
    seen.check("c", 5, 5)
    assert seen.newest("c") == 5
