"""What a replica checks of a push before it buffers the adapter: whose it is, whether its
learner still holds the run, and whether the replica has room for it.

- **Ownership.** An adapter name belongs to its run, `<run_id>/<policy>`
  (marl.runtime.fences): a push that names a run (`manifest.run_id`) may only push that
  run's adapters, so one run's learner cannot load, or retire by pushing newer
  versions, another run's. A push that names no run (an evaluation's, `marl episode`'s)
  may only name a run no learner ever leased.
- **Fencing.** The push's `manifest.fence` must be no older than the newest token this
  replica saw pushed for the run, nor than the run's current one in Redis (when the
  replica has Redis): a learner that lost its run's lease is refused (ABORTED) even if
  this replica never saw the new holder's pushes.
- **Room.** Pushes are buffered whole before they load; `max_concurrent_pushes` at once,
  and `max_push_bytes` of their declared sizes together, are the most a replica takes
  (RESOURCE_EXHAUSTED past either: the learner tries again).

What this does not protect against: fencing tokens are counters, not secrets, so a
caller with the service token can name any run and guess its token; the service token (and, issue 76, refusing
user tokens on PushAdapter) is what keeps other callers out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc
import redis.asyncio as aioredis

from marl.protocol.v1 import common_pb2
from marl.runtime import fences


class PushRefused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


async def check_owner(
    m: common_pb2.AdapterManifest, seen: fences.PushFences, r: aioredis.Redis | None
) -> None:
    """PushRefused unless the push's run owns the adapter name and its fencing token is
    current (see the module's docstring)."""
    ref = f"{m.ref.name}@{m.ref.version}"
    owner = fences.run_of_adapter(m.ref.name)
    if "/" not in m.ref.name or not owner:
        raise PushRefused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"adapter {ref}: manifest.ref.name must be `<run_id>/<policy>`",
        )
    if m.run_id and m.run_id != owner:
        raise PushRefused(
            grpc.StatusCode.PERMISSION_DENIED,
            f"adapter {ref} belongs to run {owner}; a push of run {m.run_id} may only "
            f"name {m.run_id}/<policy>",
        )
    current = None if r is None else await fences.current(r, owner)
    if not m.run_id and max(current or 0, seen.newest(owner)) > 0:
        raise PushRefused(
            grpc.StatusCode.PERMISSION_DENIED,
            f"adapter {ref} belongs to run {owner}, which a learner trains; only a push "
            "that names its run (manifest.run_id) and carries its lease's fencing token "
            "may load it",
        )
    try:
        seen.check(owner, m.fence, current)
    except fences.StaleFence as err:
        raise PushRefused(grpc.StatusCode.ABORTED, f"adapter {ref}: {err}") from None


class PushBudget:
    """The pushes a replica buffers at once, in number and in declared bytes."""

    def __init__(self, max_pushes: int, max_bytes: int):
        self.max_pushes = max_pushes
        self.max_bytes = max_bytes
        self.pushes = 0
        self.bytes = 0

    @contextlib.contextmanager
    def reserve(self, ref: str, size: int) -> Iterator[None]:
        """Hold room for one push of `size` bytes while it is buffered and loaded;
        PushRefused (RESOURCE_EXHAUSTED) when there is none."""
        if size > self.max_bytes:
            raise PushRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"adapter {ref}: {size} bytes is more than this replica's max_push_bytes "
                f"({self.max_bytes}); start it with a larger max_push_bytes",
            )
        if self.pushes >= self.max_pushes:
            raise PushRefused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"adapter {ref}: this replica is taking {self.pushes} pushes already (its "
                "max_concurrent_pushes); push again shortly",
            )
        if self.bytes + size > self.max_bytes:
            raise PushRefused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"adapter {ref}: {size} bytes would take the pushes under way past "
                f"{self.max_bytes} bytes (this replica's max_push_bytes); push again shortly",
            )
        self.pushes += 1
        self.bytes += size
        try:
            yield
        finally:
            self.pushes -= 1
            self.bytes -= size
