"""One object owns the run's adapters on the inference replicas: publish, push, acks,
late-replica sync and release.

After each update the current version of every adapter is published in Redis
(names and versions, not weights), pushed to every live replica and each
acknowledgement recorded (`acks_key`); a sync loop pushes them to replicas that start mid-run
(such a replica reports SERVING only once it holds them). When the run ends its
adapters are unloaded from every replica (the checkpoints keep them) and its record of
acknowledgements expires a day later.

Versions are never reused: a run taken over after its learner died starts a new
version range (`version_base`), since a replica refuses a name@version it already
holds with other weights.

Every push names the run and carries the fencing token of this learner's lease on it
(`lease`): before each push the lease is checked in Redis, and a replica refuses a
token older than the run's newest, so a learner that lost the run pushes nothing more.
A replica busy with other pushes (RESOURCE_EXHAUSTED: its caps on pushes at once and
their bytes) is tried again, as one that does not answer is.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import redis.asyncio as aioredis

from marl.protocol import adapter_io
from marl.protocol.rpc_codes import NO_ANSWER
from marl.protocol.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from marl.rollout import AdapterRef
from marl.runtime import auth, replicas
from marl.runtime.aio_tasks import cancel_until_done, raise_if_cancelled
from marl.runtime.torch_thread import TorchThread
from marl.spec.run import RunSpec
from marl.spec.services import auth_token
from services.learner.errors import ReplicaUnreachable, RunFailed
from services.learner.lease import Lease
from services.learner.runs import acks_key

log = logging.getLogger(__name__)

PUSH_DEADLINE_S = 300.0
CHANNEL_OPTIONS = [("grpc.max_reconnect_backoff_ms", 1000)]
"""A replica back at its address is reached within a second, as the workers' channels do."""
REPLICA_WAIT_S = 300.0
"""How long a push waits for an inference replica to take it, when none is live or every
live one is unreachable (the only one restarting; workers wait `replica_wait_s` for one
to take a turn)."""
SYNC_INTERVAL_S = 1.0
SYNC_RETRY_S = 5.0
RELEASE_DEADLINE_S = 30.0
ACKS_KEPT_S = 24 * 3600
"""How long a run's record of acknowledgements (`acks_key`) outlives the run: long enough to
see afterwards which replica took which version when, without every finished run keeping
one in Redis for good."""


@dataclass
class Published:
    """The current version of one adapter, kept so replicas that join later get these bytes."""

    version: int
    manifest: common_pb2.AdapterManifest
    payload: bytes


def adapter_bytes(policy: Any, p: str) -> bytes:
    """Adapter p's weights as pushed, serialized where the policy lives: bytes come back
    from a policy in a process of its own faster than its tensors would (torch hands
    tensors between processes through shared memory, a segment each;
    `bench/policy_process.py`). Call it through `PolicyHandle.call`."""
    return adapter_io.serialize(policy.state_dict(p))


class AdapterSync:
    def __init__(
        self,
        run_id: str,
        spec: RunSpec,
        r: aioredis.Redis,
        roles: dict[str, str],
        base_model: str,
        torch_thread: TorchThread,
        version_base: int = 0,
        check_cancel: Callable[[], Awaitable[None]] | None = None,
        owner: str = "",
        lease: Lease | None = None,
    ):
        """`check_cancel` raises when the run was cancelled: a push waiting for a replica
        asks it each second, so CancelRun does not wait out REPLICA_WAIT_S. `owner`: the
        run's owner, whom replicas serve its adapters to (besides admins and services).
        `lease`: the run's lease, checked before each push; its fencing token goes with
        the push."""
        self.run_id = run_id
        self.owner = owner
        self.spec = spec
        self.r = r
        self.roles = roles
        self.policy_names = sorted(set(roles.values()))
        self.base_model = base_model
        self.torch = torch_thread
        self.version_base = version_base
        self.check_cancel = check_cancel
        self.lease = lease
        self.versions = dict.fromkeys(self.policy_names, version_base)
        self.recent: dict[str, list[Published]] = {}
        """Policy -> its last `train.versions_per_adapter` versions, oldest first (the
        current one last): what tasks queued ahead may still name, so what a replica that
        joins mid-run gets."""
        # (replica id, policy, version): acknowledged, being pushed, last failed at
        self._acked: set[tuple[str, str, int]] = set()
        self._pushes: dict[tuple[str, str, int], asyncio.Task[None]] = {}
        self._failed_at: dict[tuple[str, str, int], float] = {}
        self._publish_lock = asyncio.Lock()
        self._sync: asyncio.Task[None] | None = None
        self._short_of_slots: set[str] = set()
        """Replicas already warned of (`check_lora_slots`)."""
        self._channels: dict[tuple[str, str | None], grpc.aio.Channel] = {}
        """(replica address, auth token) -> the channel every push to it takes: a channel
        of its own per push put a connection's setup on every step's critical path. A new
        token (a rotated Secret) opens a new channel."""

    @property
    def current(self) -> dict[str, Published]:
        """Policy -> the version of it published last."""
        return {p: versions[-1] for p, versions in self.recent.items()}

    def adapter_name(self, policy: str) -> str:
        return f"{self.run_id}/{policy}"

    def refs(self) -> dict[str, AdapterRef]:
        """Role -> the adapter version that must serve it now."""
        return {
            role: AdapterRef(self.adapter_name(p), self.versions[p])
            for role, p in self.roles.items()
        }

    def reroute(self) -> None:
        """`roles` changed (a split, guard.py, or a resumed run's routing): the adapters are
        those it names now, each at the current version (pushed by the next `push`)."""
        version = max(self.versions.values())
        self.policy_names = sorted(set(self.roles.values()))
        self.versions = dict.fromkeys(self.policy_names, version)

    def set_step(self, step: int) -> None:
        """Adapters after `step` updates are version version_base + step."""
        self.versions = dict.fromkeys(self.policy_names, self.version_base + step)

    async def start(self) -> None:
        self._sync = asyncio.create_task(self.sync_replicas())
        self._sync.add_done_callback(_log_crash)

    async def close(self, release: bool = True) -> None:
        """Stop pushing; `release`: the run is over, so its adapters are unloaded from the
        replicas and no longer current (False: another learner holds the run now)."""
        await cancel_until_done([*([self._sync] if self._sync else []), *self._pushes.values()])
        await self.close_channels(set())
        if not release:
            return
        await replicas.retire_current(self.r, [self.adapter_name(p) for p in self.current])
        await self.release_adapters()
        await self.r.expire(acks_key(self.run_id), ACKS_KEPT_S)

    async def push(self, policy: Any) -> None:
        """Publish the current version of every adapter, push it to every live replica and
        wait for all acks."""
        await self.send(await self.snapshot(policy))

    async def snapshot(self, policy: Any) -> dict[str, Published]:
        """The current version of every adapter as it will be pushed: taken on the torch
        thread, so a later update queued there cannot change what is sent."""
        current = {}
        for p in self.policy_names:
            payload = await self.torch.run(policy.call, adapter_bytes, p)
            manifest = adapter_io.make_manifest(
                self.adapter_name(p),
                self.versions[p],
                base_model=self.base_model,
                rank=self.spec.lora.rank,
                alpha=self.spec.lora.alpha,
                target_modules=policy.target_modules(p),
                payload=payload,
                # tasks queued K versions before they are generated still find theirs
                keep_versions=self.spec.train.versions_per_adapter,
                owner=self.owner,
                run_id=self.run_id,
                fence=0 if self.lease is None else self.lease.fence,
            )
            current[p] = Published(self.versions[p], manifest, payload)
        return current

    async def send(
        self, current: dict[str, Published], beside: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        """Publish a snapshot, push it to every live replica and wait for all acks.
        Publishing first means a replica that joins meanwhile either is one of these
        targets or waits for this version before it serves. While no replica took a
        version (none is live, or every live one is gone: the only one restarting), push
        again to what is live each second, for up to REPLICA_WAIT_S. Nothing is published
        or pushed once the run's lease is lost (LeaseLost).

        `beside` (the tasks the new versions serve) runs once they are published, while
        they are pushed, when every replica to push to serves already: each holds a request
        for a published version until its push lands (`InferenceService._acquire`), so the
        workers start their episodes meanwhile. Otherwise it runs after the acks."""
        if self.lease is not None:
            await self.lease.check()
        for p, pub in current.items():
            recent = self.recent.setdefault(p, [])
            if not recent or recent[-1].version != pub.version:
                recent.append(pub)
            del recent[: -self.spec.train.versions_per_adapter]
        await self.publish()
        if beside is None:
            await self._push_until_taken(current)
        elif not await self._every_target_serves():
            await self._push_until_taken(current)
            await beside()
        else:
            pushing = asyncio.create_task(self._push_until_taken(current))
            try:
                await beside()
            except BaseException:
                await cancel_until_done({pushing})
                raise
            await pushing

    async def _every_target_serves(self) -> bool:
        live = await replicas.live(self.r, "inference", include_joining=True)
        targets = [v for v in live.values() if v.get("base_model") == self.base_model]
        return bool(targets) and all(v.get("serving", True) for v in targets)

    async def _push_until_taken(self, current: dict[str, Published]) -> None:
        deadline = time.monotonic() + REPLICA_WAIT_S
        waiting = False
        while True:
            live = await replicas.live(self.r, "inference", include_joining=True)
            targets = {k: v for k, v in live.items() if v.get("base_model") == self.base_model}
            self.check_lora_slots(targets)
            await self.close_channels({v["address"] for v in live.values()})
            unreachable = await self._push_round(targets, current)
            untaken = [
                f"{self.adapter_name(p)}@{pub.version}"
                for p, pub in current.items()
                if not any((rid, p, pub.version) in self._acked for rid in targets)
            ]
            if not untaken:
                return
            if targets:
                why = "; ".join(unreachable)
            else:
                seen = sorted({str(v.get("base_model")) for v in live.values()})
                why = (f"no live inference replica serves base model {self.base_model} (live "
                       f"replicas serve {seen or 'nothing'}); start one with the run's model.path")
            if time.monotonic() > deadline:
                raise RunFailed(
                    f"no inference replica took {', '.join(untaken)} within "
                    f"{REPLICA_WAIT_S:.0f}s: {why}"
                )
            if not waiting:  # one that registers again gets them here or from sync_replicas
                log.warning("no inference replica took %s (%s); waiting up to %.0fs for one",
                            ", ".join(untaken), why, REPLICA_WAIT_S)
                waiting = True
            if self.check_cancel is not None:
                await self.check_cancel()
            await asyncio.sleep(1.0)
            if self.lease is not None:
                await self.lease.check()

    async def _push_round(
        self, targets: dict[str, dict[str, Any]], current: dict[str, Published]
    ) -> list[str]:
        """Push every version of `current` to every target that has not acknowledged it;
        returns why each unreachable target failed (a refusal raises RunFailed)."""
        results = await asyncio.gather(
            *(
                self._push_to(rid, info["address"], p, pub)
                for rid, info in targets.items()
                for p, pub in current.items()
                if (rid, p, pub.version) not in self._acked
            ),
            return_exceptions=True,
        )
        unreachable = []
        for result in results:
            if isinstance(result, ReplicaUnreachable):
                unreachable.append(str(result))
            elif isinstance(result, BaseException):
                raise result
        return unreachable

    async def publish(self) -> None:
        """Record (or refresh) the current versions in Redis; serialised so that a refresh
        taken before a new version was published cannot land after it."""
        async with self._publish_lock:
            versions = {self.adapter_name(p): pub.version for p, pub in self.current.items()}
            await replicas.publish_current(
                self.r, self.base_model, self.run_id, versions, owner=self.owner
            )

    def _push_to(self, rid: str, address: str, p: str, pub: Published) -> asyncio.Task[None]:
        """The push of one version of p to one replica; a push already under way (from a
        step or from the sync loop) is shared, not repeated."""
        key = (rid, p, pub.version)
        task = self._pushes.get(key)
        if task is None:
            task = asyncio.create_task(self._push_one(rid, address, p, pub))
            self._pushes[key] = task

            def done(t: asyncio.Task[None]) -> None:
                del self._pushes[key]
                if not t.cancelled() and t.exception() is not None:
                    self._failed_at[key] = time.monotonic()
                    log.warning("%s", t.exception())

            task.add_done_callback(done)
        return task

    def channel(self, address: str) -> grpc.aio.Channel:
        key = (address, auth_token())
        if key not in self._channels:
            self._channels[key] = auth.aio_channel(address, CHANNEL_OPTIONS)
        return self._channels[key]

    async def close_channels(self, keep: set[str]) -> None:
        """Close the channels to every address but `keep`'s (replicas gone, or a token
        rotated away from)."""
        token = auth_token()
        for key in [k for k in self._channels if k[0] not in keep or k[1] != token]:
            await self._channels.pop(key).close()

    async def _push_one(self, rid: str, address: str, p: str, pub: Published) -> None:
        stub = inference_pb2_grpc.InferenceStub(self.channel(address))
        try:
            await stub.PushAdapter(
                adapter_io.chunks(pub.manifest, pub.payload), timeout=PUSH_DEADLINE_S
            )
        except grpc.aio.AioRpcError as err:
            ref = f"{self.adapter_name(p)}@{pub.version}"
            if err.code() in NO_ANSWER:  # the replica went away, it did not refuse
                # the next try connects afresh, not after the channel's reconnect backoff
                await self.close_channels({a for a, _ in self._channels} - {address})
                raise ReplicaUnreachable(
                    f"inference replica {rid} ({address}) unreachable for {ref}: "
                    f"{err.details()}"
                ) from None
            if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # busy: try it again
                raise ReplicaUnreachable(
                    f"inference replica {rid} ({address}) busy for {ref}: {err.details()}"
                ) from None
            if self.lease is not None and err.code() == grpc.StatusCode.ABORTED:
                raise self.lease.lost_to(
                    f"inference replica {rid} refused {ref}: {err.details()}"
                ) from None
            raise RunFailed(
                f"inference replica {rid} ({address}) refused adapter {ref}: {err.details()}"
            ) from None
        self._acked.add((rid, p, pub.version))
        await self.r.hset(acks_key(self.run_id), f"{rid}/{p}@{pub.version}", time.time())

    async def release_adapters(self) -> None:
        """Unload this run's adapters from every live replica once the run is over (the
        checkpoints keep them), so a long-lived cluster does not grow with every run. A
        replica that cannot be reached is only logged: its memory dies with it."""
        names = {self.adapter_name(p) for p in self.policy_names}
        live = await replicas.live(self.r, "inference", include_joining=True)

        async def release(rid: str, address: str) -> None:
            async with auth.aio_channel(address) as channel:
                stub = inference_pb2_grpc.InferenceStub(channel)
                try:
                    listed = await stub.ListAdapters(
                        inference_pb2.ListAdaptersRequest(), timeout=RELEASE_DEADLINE_S
                    )
                    for loaded in listed.adapters:
                        if loaded.ref.name in names:
                            await stub.UnloadAdapter(
                                inference_pb2.UnloadAdapterRequest(ref=loaded.ref),
                                timeout=RELEASE_DEADLINE_S,
                            )
                except grpc.aio.AioRpcError as err:
                    if err.code() != grpc.StatusCode.NOT_FOUND:
                        log.warning(
                            "could not release %s's adapters on %s: %s",
                            self.run_id,
                            rid,
                            err.details(),
                        )

        await asyncio.gather(*(release(rid, info["address"]) for rid, info in live.items()))

    async def sync_replicas(self) -> None:
        """Keep the published versions fresh and push them to every live replica that has
        not acknowledged them: one that started mid-run waits for the current ones before
        it serves, and gets the K before them too (`recent`), which queued tasks name."""
        while self.lease is None or self.lease.lost is None:
            await asyncio.sleep(SYNC_INTERVAL_S)
            if not self.recent:
                continue
            await self.publish()
            live = await replicas.live(self.r, "inference", include_joining=True)
            raise_if_cancelled()  # lost in publish() or live(): start no push close() misses
            now = time.monotonic()
            for rid, info in live.items():
                if info.get("base_model") != self.base_model:
                    continue
                for p, versions in self.recent.items():
                    for pub in versions:
                        key = (rid, p, pub.version)
                        failed_at = self._failed_at.get(key)
                        if key in self._acked or key in self._pushes:
                            continue
                        if failed_at is not None and now - failed_at < SYNC_RETRY_S:
                            continue
                        log.info(
                            "pushing %s@%d to replica %s", self.adapter_name(p), pub.version, rid
                        )
                        self._push_to(rid, info["address"], p, pub)

    def check_lora_slots(self, targets: dict[str, dict[str, Any]]) -> None:
        """Warn, once per replica, when a replica's batches hold fewer adapter versions
        (vLLM's `max_loras`) than this run may have in flight, each adapter's newest and
        the K before it (`marl.workflows.routing.adapter_versions_in_flight`): requests
        beyond its slots then wait for a batch with room, and generation slows."""
        need = len(self.policy_names) * self.spec.train.versions_per_adapter
        for rid, info in targets.items():
            slots = info.get("lora_slots")
            if slots is None or slots >= need or rid in self._short_of_slots:
                continue
            self._short_of_slots.add(rid)
            log.warning(
                "run %s may have %d adapter versions in flight (%d adapters x "
                "train.max_staleness + 1 = %d), but inference replica %s (%s) batches at "
                "most %d (its max_loras): requests for the others wait for a batch with "
                "room. Start it with max_loras >= %d.",
                self.run_id, need, len(self.policy_names),
                self.spec.train.versions_per_adapter, rid, info.get("address"), slots, need,
            )


def _log_crash(task: asyncio.Task[None]) -> None:
    # Training goes on without the sync loop; replicas that start later serve once the
    # published versions expire, and workers fail over from them until a step's push.
    if not task.cancelled() and task.exception() is not None:
        log.error("adapter sync loop crashed", exc_info=task.exception())
