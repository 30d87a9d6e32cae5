"""The replica registry: one Redis key per replica that expires by itself."""

from __future__ import annotations

from marl.runtime import replicas, streams


async def test_a_replica_key_expires_by_itself_and_withdraw_removes_it(redis_url: str) -> None:
    r = streams.connect(redis_url)
    try:
        info = {"address": "127.0.0.1:1", "serving": True}
        await replicas.announce(r, "inference", "a", info)
        await replicas.announce(r, "inference", "b", {**info, "serving": False})
        ttl = await r.pttl(replicas.replica_key("inference", "a"))
        assert 0 < ttl <= replicas.MAX_AGE_S * 1000  # a SIGKILLed replica leaves nothing
        assert set(await replicas.live(r, "inference")) == {"a"}
        assert set(await replicas.live(r, "inference", include_joining=True)) == {"a", "b"}
        await replicas.withdraw(r, "inference", "a")
        assert set(await replicas.live(r, "inference", include_joining=True)) == {"b"}
        await r.pexpire(replicas.replica_key("inference", "b"), 1)
        await r.execute_command("DEBUG", "SLEEP", "0.01")
        assert await replicas.live(r, "inference", include_joining=True) == {}
        assert await r.keys("marl:replicas:*") == []
    finally:
        await r.aclose()
