"""ListRuns in pages, on a real Redis and a real grpc.aio server in this process: pages in
order with no run twice or missing, a user's pages hold its own runs only, a page stops
before its message grows past PAGE_BYTES, and a page token no learner gave is refused."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from marl.protocol.v1 import learner_pb2, learner_pb2_grpc
from marl.runtime import streams
from marl.runtime.auth import TokenAuth, TokenBook
from services.learner import server as learner_server
from services.learner.runs import INDEX, RunStore, run_key
from services.learner.server import LearnerService, page_position, page_token


@pytest.fixture()
async def learner(redis_url: str, tmp_path: Path) -> AsyncIterator[tuple[Any, RunStore]]:
    """The Runs API with the services' token `svc` and users alice and bob (calls without
    metadata come from no one and are refused; `as_user` adds it)."""
    r = streams.connect(redis_url)
    store = RunStore(r)
    users = tmp_path / "users.csv"
    users.write_text("alice-token,alice,1\nbob-token,bob,2\n")
    server = grpc.aio.server(interceptors=[TokenAuth(TokenBook("svc", str(users)))])
    learner_pb2_grpc.add_LearnerServicer_to_server(
        LearnerService(r, store, tmp_path, retention_s=0), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=[
        _Auth("svc")])
    try:
        yield learner_pb2_grpc.LearnerStub(channel), store
    finally:
        await channel.close()
        await server.stop(None)
        await r.aclose()


class _Auth(grpc.aio.UnaryUnaryClientInterceptor):
    """Sends `Bearer <token>` unless the call names its own."""

    def __init__(self, token: str):
        self.token = token

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        if not details.metadata:
            details = details._replace(metadata=[("authorization", f"Bearer {self.token}")])
        return await continuation(details, request)


async def pages(stub: Any, size: int, token_of: str = "svc") -> list[list[str]]:
    out, token = [], ""
    while True:
        resp = await stub.ListRuns(learner_pb2.ListRunsRequest(page_size=size, page_token=token),
                                   metadata=[("authorization", f"Bearer {token_of}")],
                                   timeout=30)
        out.append([r.run_id for r in resp.runs])
        token = resp.next_page_token
        if not token:
            return out


async def test_pages_in_order_none_twice_none_missing(learner: tuple[Any, RunStore]) -> None:
    stub, store = learner
    ids = [f"run-{i:03d}" for i in range(7)]
    for i, run_id in enumerate(ids):
        await store.create(run_id, "spec", "/tmp/x", 1, owner="alice" if i % 3 else "bob")
    # two runs created at the same instant are ordered by id, as Redis orders them
    await store.r.zadd(INDEX, {"run-003": 1.0, "run-002": 1.0})
    order = ["run-002", "run-003", *[i for i in ids if i not in ("run-002", "run-003")]]
    assert await pages(stub, 3) == [order[:3], order[3:6], order[6:]]
    assert await pages(stub, 1) == [[i] for i in order]
    assert await pages(stub, 0) == [order]  # the default page holds them all
    assert [i for p in await pages(stub, 1000_000) for i in p] == order  # read as 1000
    # a run forgotten between two pages is skipped, the rest still come
    first = await stub.ListRuns(learner_pb2.ListRunsRequest(page_size=2), timeout=30)
    await store.r.delete(run_key(order[2]))
    rest = await stub.ListRuns(learner_pb2.ListRunsRequest(
        page_size=100, page_token=first.next_page_token), timeout=30)
    assert [r.run_id for r in rest.runs] == order[3:]


async def test_a_users_pages_hold_its_own_runs(learner: tuple[Any, RunStore]) -> None:
    stub, store = learner
    for i in range(6):
        await store.create(f"run-{i}", "spec", "/tmp/x", 1, owner="alice" if i % 2 else "bob")
    await store.r.hdel(run_key("run-0"), "owner")  # a run from before owners: anonymous
    assert await pages(stub, 2, "alice-token") == [["run-1", "run-3"], ["run-5"]]
    assert await pages(stub, 5, "bob-token") == [["run-2", "run-4"]]
    assert await pages(stub, 6) == [[f"run-{i}" for i in range(6)]]  # the services: all


async def test_a_page_stops_before_its_bytes_pass_the_bound(
        learner: tuple[Any, RunStore], monkeypatch: pytest.MonkeyPatch) -> None:
    stub, store = learner
    monkeypatch.setattr(learner_server, "PAGE_BYTES", 25_000)
    for i in range(5):
        await store.create(f"run-{i}", "x" * 10_000, "/tmp/x", 1)
    assert await pages(stub, 100) == [["run-0", "run-1"], ["run-2", "run-3"], ["run-4"]]
    monkeypatch.setattr(learner_server, "PAGE_BYTES", 10)
    assert await pages(stub, 100) == [[f"run-{i}"] for i in range(5)]  # one run at least


@pytest.mark.parametrize("bad", ["x", "!!!!", "W10=", "WyJhIiwgImIiXQ==", "a" * 600,
                                 "WzEsIDJd", "W3RydWUsICJhIl0=", "W05hTiwgImEiXQ==",
                                 "WzFlOTk5LCAiYSJd", "5Yid", "\x00"])
async def test_refuse_a_page_token_no_learner_gave(learner: tuple[Any, RunStore],
                                                   bad: str) -> None:
    stub, _ = learner
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.ListRuns(learner_pb2.ListRunsRequest(page_token=bad), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("page_token: not a token a learner gave")


async def test_refuse_a_negative_page_size(learner: tuple[Any, RunStore]) -> None:
    stub, _ = learner
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.ListRuns(learner_pb2.ListRunsRequest(page_size=-1), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("page_size: must be 0")


def test_page_token_round_trip() -> None:
    assert page_position(page_token((1712345678.123456, "run-abc"))) == (
        1712345678.123456, "run-abc")
    assert page_position("") is None
