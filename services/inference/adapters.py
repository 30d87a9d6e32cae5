"""Adapter versions on one replica: immutable, counted while in use, retired safely.

Every version is its own adapter (`run/policy@version`, its own int id), never
reloaded in place. A request holds its version for its whole life; a version
older than the newest `retention` of its adapter is unloaded only once no
request holds it. A push may ask for more versions of its adapter to be kept
(`keep`: a run with bounded staleness K queues tasks K versions ahead of their
generation, so it needs K + 1). A request for a version that is not loaded fails;
there is no fallback to the base model. Each version records its owner (the user whose
run pushed it, from the manifest); a request made for a user (`user`) sees that user's
versions only, so another user's adapter is absent to it, exactly as one never pushed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

MAX_KEEP_VERSIONS = 64
"""The most versions of one adapter a push may ask a replica to keep."""


class AdapterNotLoaded(LookupError):
    """The named adapter version is not (or no longer) on this replica."""


def adapter_key(name: str, version: int) -> str:
    return f"{name}@{version}"


@dataclass
class LoadedVersion:
    name: str
    version: int
    int_id: int
    sha256: str
    loaded_at: float = field(default_factory=time.time)
    in_flight: int = 0
    retired: bool = False
    owner: str = ""

    @property
    def key(self) -> str:
        return adapter_key(self.name, self.version)


class AdapterRegistry:
    def __init__(self, unload: Callable[[str], Awaitable[None]], retention: int):
        assert retention >= 1
        self._unload = unload
        self.retention = retention
        self._versions: dict[str, LoadedVersion] = {}
        self._next_int_id = 1
        self._lock = asyncio.Lock()
        self._added = asyncio.Event()
        """Set (and replaced) each time a version is added: what `wait_for` waits on."""

    def next_int_id(self) -> int:
        n = self._next_int_id
        self._next_int_id += 1
        return n

    def get(self, name: str, version: int) -> LoadedVersion | None:
        return self._versions.get(adapter_key(name, version))

    def all(self, user: str | None = None) -> list[LoadedVersion]:
        """Every version held, or only `user`'s."""
        return sorted((v for v in self._versions.values() if user is None or v.owner == user),
                      key=lambda v: (v.name, v.version))

    def holds(self, name: str, version: int) -> bool:
        """Whether `name@version` (or a newer version of it) can serve new requests."""
        return any(
            v.name == name and v.version >= version and not v.retired
            for v in self._versions.values()
        )

    async def added(self, loaded: LoadedVersion, keep: int = 0) -> None:
        """Record a freshly loaded version and retire what falls out of retention: the
        newest `retention` versions of its adapter stay, or `keep` (its push's
        `keep_versions`, up to MAX_KEEP_VERSIONS) when more. Versions retire only here,
        so the latest push's `keep` is the one that counts."""
        assert 0 <= keep <= MAX_KEEP_VERSIONS
        async with self._lock:
            self._versions[loaded.key] = loaded
            same = sorted(
                (v for v in self._versions.values() if v.name == loaded.name and not v.retired),
                key=lambda v: v.version,
            )
            for old in same[: -max(self.retention, keep)]:
                old.retired = True
            await self._collect()
        self._added.set()
        self._added = asyncio.Event()

    async def wait_for(self, name: str, version: int, timeout_s: float) -> bool:
        """Wait until `name@version` has been added, at most `timeout_s`; whether it was."""
        deadline = time.monotonic() + timeout_s
        while self.get(name, version) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._added.wait(), left)
            except TimeoutError:
                return False
        return True

    def acquire(self, name: str, version: int, newest: bool = False,
                user: str | None = None) -> LoadedVersion:
        """Hold `name@version` for a request (`newest`: the newest version held that is
        `version` or later) until `release`; `user`: a request made for that user, who
        sees only its own versions (None: every version)."""
        v = self._versions.get(adapter_key(name, version))
        if newest:
            v = max(
                (x for x in self._versions.values()
                 if x.name == name and x.version >= version and not x.retired),
                key=lambda x: x.version,
                default=None,
            )
        if v is not None and user is not None and v.owner != user:
            v = None
        if v is None or v.retired:
            loaded = sorted(x.version for x in self._versions.values()
                            if x.name == name and (user is None or x.owner == user))
            raise AdapterNotLoaded(
                f"adapter {adapter_key(name, version)} is not loaded on this replica"
                f" (loaded versions of {name}: {loaded or 'none'}); push it first"
            )
        v.in_flight += 1
        return v

    async def release(self, v: LoadedVersion) -> None:
        v.in_flight -= 1
        if v.retired and v.in_flight == 0:
            async with self._lock:
                await self._collect()

    async def retire(self, name: str, version: int) -> bool:
        """Explicit unload: retire now, unload as soon as no request holds it."""
        v = self._versions.get(adapter_key(name, version))
        if v is None:
            return False
        async with self._lock:
            v.retired = True
            await self._collect()
        return True

    async def _collect(self) -> None:
        for key, v in list(self._versions.items()):
            if v.retired and v.in_flight == 0:
                del self._versions[key]
                await self._unload(key)
