"""Adapter versions: retention, in-flight protection, no fallback."""

from __future__ import annotations

import pytest

from services.inference.adapters import AdapterNotLoaded, AdapterRegistry, LoadedVersion


async def test_old_versions_unload_only_when_idle() -> None:
    unloaded: list[str] = []

    async def unload(key: str) -> None:
        unloaded.append(key)

    reg = AdapterRegistry(unload, retention=2)
    await reg.added(LoadedVersion("r/p", 0, reg.next_int_id(), "a"))
    held = reg.acquire("r/p", 0)
    await reg.added(LoadedVersion("r/p", 1, reg.next_int_id(), "b"))
    await reg.added(LoadedVersion("r/p", 2, reg.next_int_id(), "c"))
    assert unloaded == []  # v0 is out of retention but still serving a request
    with pytest.raises(AdapterNotLoaded):
        reg.acquire("r/p", 0)  # retired: no new requests
    await reg.release(held)
    assert unloaded == ["r/p@0"]
    assert [v.version for v in reg.all()] == [1, 2]
    assert len({v.int_id for v in reg.all()}) == 2


async def test_unknown_version_names_what_is_loaded() -> None:
    async def unload(key: str) -> None: ...

    reg = AdapterRegistry(unload, retention=2)
    await reg.added(LoadedVersion("r/p", 3, reg.next_int_id(), "a"))
    with pytest.raises(AdapterNotLoaded, match=r"r/p@4 is not loaded.*\[3\]"):
        reg.acquire("r/p", 4)


async def test_holds_a_version_or_a_newer_one_until_retired() -> None:
    async def unload(key: str) -> None: ...

    reg = AdapterRegistry(unload, retention=1)
    assert not reg.holds("r/p", 0)
    await reg.added(LoadedVersion("r/p", 1, reg.next_int_id(), "a"))
    assert reg.holds("r/p", 0) and reg.holds("r/p", 1)
    assert not reg.holds("r/p", 2) and not reg.holds("r/q", 0)
    held = reg.acquire("r/p", 1)
    await reg.added(LoadedVersion("r/p", 2, reg.next_int_id(), "b"))
    await reg.retire("r/p", 2)
    assert not reg.holds("r/p", 1)  # still loaded for its request, but retired
    await reg.release(held)


async def test_a_push_may_keep_more_versions_than_retention() -> None:
    unloaded: list[str] = []

    async def unload(key: str) -> None:
        unloaded.append(key)

    reg = AdapterRegistry(unload, retention=2)
    for v in range(5):
        await reg.added(LoadedVersion("r/p", v, reg.next_int_id(), str(v)), keep=3)
    await reg.added(LoadedVersion("r/q", 0, reg.next_int_id(), "q"), keep=1)  # below: 2
    await reg.added(LoadedVersion("r/q", 1, reg.next_int_id(), "q"), keep=1)
    assert unloaded == ["r/p@0", "r/p@1"]
    assert [(v.name, v.version) for v in reg.all()] == [
        ("r/p", 2), ("r/p", 3), ("r/p", 4), ("r/q", 0), ("r/q", 1)]
    await reg.added(LoadedVersion("r/p", 5, reg.next_int_id(), "5"))  # keep 0: retention's 2
    assert [v.version for v in reg.all() if v.name == "r/p"] == [4, 5]
    assert unloaded == ["r/p@0", "r/p@1", "r/p@2", "r/p@3"]
