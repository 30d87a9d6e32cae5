"""The engine thread answers a decode step's finished rows with one wake-up of their loop."""

from __future__ import annotations

import asyncio
import threading

from services.inference.engine import GenerationRequest, GenerationResult
from services.inference.transformers_engine import _Pending, settle_all


def test_a_steps_outcomes_reach_their_callers_in_one_wake_up() -> None:
    async def go() -> None:
        loop = asyncio.get_running_loop()
        wake_ups = []
        call_soon_threadsafe = loop.call_soon_threadsafe

        def counted(*args):  # type: ignore[no-untyped-def]
            wake_ups.append(threading.get_ident())
            return call_soon_threadsafe(*args)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign,assignment]
        request = GenerationRequest([1, 2], "a", 4)
        pending = [_Pending(request, loop.create_future(), loop) for _ in range(4)]
        pending[3].future.cancel()  # its caller went away: skipped, not an error
        error = KeyError("adapter a was unloaded")
        outcomes = [(p, GenerationResult([i], [-0.5], "stop")) for i, p in enumerate(pending[:2])]
        engine_thread = threading.Thread(target=settle_all, args=(
            [*outcomes, (pending[2], error), (pending[3], GenerationResult([], [], "length"))],))
        engine_thread.start()
        results = await asyncio.gather(*(p.future for p in pending[:3]), return_exceptions=True)
        engine_thread.join()
        assert results[:2] == [GenerationResult([0], [-0.5], "stop"),
                               GenerationResult([1], [-0.5], "stop")]
        assert results[2] is error
        assert wake_ups == [engine_thread.ident]

    asyncio.run(go())
