"""InferenceService.GenerateMany's replies: outcomes done together share a message, up to
a byte budget. In process, on an engine that answers every request at once (the real
replica is tested in tests/integration/test_inference_bad_input.py)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from marl.models.limits import ModelLimits
from marl.protocol.v1 import common_pb2, inference_pb2
from services.inference import server
from services.inference.adapters import AdapterRegistry, LoadedVersion
from services.inference.engine import GenerationRequest, GenerationResult


class EchoEngine:
    """Answers `max_tokens` copies of the prompt's first token."""

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if request.prompt_token_ids[0] == 99:
            raise RuntimeError("engine failed this row")
        n = request.max_tokens
        return GenerationResult([request.prompt_token_ids[0]] * n, [-0.5] * n, "length")


class Context:
    async def abort(self, code: Any, details: str) -> None:
        raise AssertionError(f"aborted: {code} {details}")

    def peer(self) -> str:
        return "ipv4:127.0.0.1:50000"


async def replies(n: int, max_tokens: int, first: int = 1, version: int = 1, joined: bool = True
                  ) -> list[inference_pb2.GenerateManyResponse]:
    """GenerateMany of `n` requests for run/p@`version` on a replica holding run/p@1."""
    service = server.InferenceService("r-test", ModelLimits(context=512, vocab_size=100))
    service.joined = joined

    async def unload(key: str) -> None:
        pass

    registry = AdapterRegistry(unload, retention=2)
    await registry.added(LoadedVersion("run/p", 1, 1, "0" * 64))
    service.attach(EchoEngine(), registry)  # type: ignore[arg-type]
    many = inference_pb2.GenerateManyRequest(requests=[
        inference_pb2.GenerateRequest(
            prompt_token_ids=[i + first, 2],
            adapter=common_pb2.AdapterRef(name="run/p", version=version),
            sampling=inference_pb2.SamplingParams(max_tokens=max_tokens))
        for i in range(n)])
    return [m async for m in service.GenerateMany(many, Context())]  # type: ignore[arg-type]


async def test_outcomes_done_together_share_one_message() -> None:
    messages = await replies(10, 30)
    assert len(messages) == 1
    assert sorted(o.index for o in messages[0].outcomes) == list(range(10))
    assert all(list(o.response.token_ids) == [o.index + 1] * 30 for o in messages[0].outcomes)


async def test_a_message_stops_taking_outcomes_at_the_byte_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    one = (await replies(1, 30))[0].outcomes[0].ByteSize()
    monkeypatch.setattr(server, "GENERATE_MANY_MESSAGE_BYTES", 3 * one)
    messages = await replies(10, 30)
    assert [len(m.outcomes) for m in messages] == [3, 3, 3, 1]
    assert sorted(o.index for m in messages for o in m.outcomes) == list(range(10))


async def test_an_engine_failure_fails_its_request_alone_with_generates_message() -> None:
    outcomes = {o.index: o for m in await replies(3, 4, first=97) for o in m.outcomes}
    assert [outcomes[i].code for i in range(3)] == [0, 0, grpc.StatusCode.UNKNOWN.value[0]]
    assert outcomes[2].error == "Unexpected RuntimeError: engine failed this row"
    assert list(outcomes[1].response.token_ids) == [98] * 4


@pytest.mark.parametrize(("joined", "code"), [
    (False, grpc.StatusCode.UNAVAILABLE),
    (True, grpc.StatusCode.FAILED_PRECONDITION),
])
async def test_a_version_not_held_is_unavailable_until_the_replica_joined(
    joined: bool, code: grpc.StatusCode
) -> None:
    """A joining replica (the only one, restarted) lacks versions the learner is about to push
    it: workers take that as a replica not up yet and wait. Once joined, no push is coming."""
    (message,) = await replies(1, 4, version=2, joined=joined)
    (outcome,) = message.outcomes
    assert outcome.code == code.value[0]
    assert outcome.error.startswith("adapter run/p@2 is not loaded on this replica")
    assert ("joining" in outcome.error) is not joined
