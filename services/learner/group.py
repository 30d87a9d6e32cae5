"""The learner as one rank of a group that a launcher started: torchrun, `srun torchrun`,
a StatefulSet's pods, `marl up --learner-nodes N`.

A launcher that sets torch's env:// variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT; torchrun sets them from its rendezvous) starts `marl serve learner` once per
rank. With WORLD_SIZE above 1 each process joins one torch.distributed group (`join`):
rank 0 is the learner the world sees (the Runs API, Redis, adapter pushes, checkpoint
files); every other rank `follow`s it. Each run's policy is built on every rank, its
decoder layers sharded over the whole group (fsdp.py), and rank 0's `GroupPolicy.call`
broadcasts each call to the followers over a gloo control group, runs it on its own
shard, then gathers every rank's outcome: the same order of collectives everywhere, as
`ranks.RankedPolicy` gets from its pipes. The followers run the rank-side code that
spawned ranks run (`ranks.answer`).

A rank that raises fails the call and with it the run (`RankFailed`); the group stays
up for the next run. A rank that is gone (its process or machine died) breaks the group
for good: every rank that notices exits with `GROUP_LOST_EXIT`, the launcher restarts the
group (torchrun `--max-restarts`, a StatefulSet's pods), and the restarted rank 0 takes
its runs over from their checkpoints once their leases lapse. Nothing is marked failed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch

from marl.models.devices import resolve_device
from marl.runtime import heap
from services.learner.ranks import PolicyArgs, RankFailed, answer

log = logging.getLogger(__name__)

R = TypeVar("R")
GROUP_LOST_EXIT = 75
"""How a rank exits when a peer is gone (EX_TEMPFAIL): the launcher restarts the group."""
IDLE_TIMEOUT = timedelta(days=365)
"""How long a follower waits for rank 0's next call: a learner may sit without runs for
long. A peer that dies closes its connections, which ends the wait at once."""
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Group:
    """This process's place in the launched group."""

    rank: int
    size: int
    local_rank: int
    control: Any
    """The gloo process group calls travel on (whatever the backend of the training's)."""


_joined: Group | None = None
"""The group this process joined (at most one, as torch.distributed's default group)."""


def launch_size(env: dict[str, str] | None = None) -> int:
    """WORLD_SIZE as the launcher set it; 1 when no launcher did. A launcher that sets some
    of the env:// variables but not all is refused, naming the ones missing."""
    env = dict(os.environ) if env is None else env
    if "WORLD_SIZE" not in env:
        return 1
    missing = [v for v in LAUNCH_VARIABLES if not env.get(v)]
    if missing:
        raise ValueError(
            f"WORLD_SIZE is set but {', '.join(missing)} is not: a launched learner needs "
            f"all of {', '.join(LAUNCH_VARIABLES)} (torchrun sets them); unset WORLD_SIZE "
            "to run one learner process"
        )
    try:
        size = int(env["WORLD_SIZE"])
        rank = int(env["RANK"])
    except ValueError:
        raise ValueError("WORLD_SIZE and RANK must be whole numbers") from None
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"RANK={rank} is not a rank of WORLD_SIZE={size}")
    return size


def join() -> Group | None:
    """Join the group the launcher started this process in (env://); None when it started
    one process (no WORLD_SIZE, or 1). CUDA tensors travel over NCCL, CPU tensors over gloo."""
    global _joined
    import torch.distributed as dist

    if launch_size() == 1:
        return None
    assert _joined is None, "a process joins one learner group"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        backend = "cpu:gloo,cuda:nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend, init_method="env://")
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    _joined = Group(dist.get_rank(), dist.get_world_size(), local_rank, control)
    log.info("learner rank %d of %d (local rank %d)", _joined.rank, _joined.size, local_rank)
    return _joined


def joined() -> Group | None:
    return _joined


def _group_lost(group: Group, err: BaseException) -> None:
    log.critical(
        "learner rank %d: the group of %d is broken (%s: %s); exiting for the launcher to "
        "restart it", group.rank, group.size, type(err).__name__, err,
    )
    os._exit(GROUP_LOST_EXIT)


def _broadcast(group: Group, message: Any) -> Any:
    """Rank 0's `message` on every rank; a broken group ends this process."""
    import torch.distributed as dist

    box = [message]
    try:
        dist.broadcast_object_list(box, src=0, group=group.control)
    except Exception as err:  # noqa: BLE001 - a peer is gone; the launcher restarts us all
        _group_lost(group, err)
    return box[0]


def _outcomes(group: Group, mine: tuple[str, Any]) -> list[tuple[str, Any]]:
    """Every rank's (status, value) for the call just run, in rank order."""
    import torch.distributed as dist

    out: list[Any] = [None] * group.size
    try:
        dist.all_gather_object(out, mine, group=group.control)
    except Exception as err:  # noqa: BLE001
        _group_lost(group, err)
    return out


class GroupPolicy:
    """Rank 0's handle on one run's policy, built and sharded on every rank of the group
    (ranks.PolicyHandle)."""

    _next_key = 0

    def __init__(self, group: Group, key: int, policy: Any, policies: list[str]):
        self.group = group
        self.key = key
        self.local = policy
        self.policies = policies
        self._targets: dict[str, list[str]] = {}

    @classmethod
    def open(cls, args: PolicyArgs, group: Group, pace: Callable[[], None] | None) -> GroupPolicy:
        assert group.rank == 0
        GroupPolicy._next_key += 1
        key = GroupPolicy._next_key
        _broadcast(group, ("open", key, args))
        local, outcome = _build(args, group)
        _raise_first_error(_outcomes(group, outcome))
        if pace is not None:
            local.pace = pace
        return cls(group, key, local, list(args.policies))

    def call(self, fn: Callable[..., R], *args: Any) -> R:
        """`fn(policy, *args)` on every rank; this rank's result. `fn` must be importable by
        name and `args` picklable."""
        _broadcast(self.group, ("call", self.key, fn, args))
        outcome = answer(self.local, fn, args, keep=True)
        _raise_first_error(_outcomes(self.group, outcome))
        return outcome[1]  # type: ignore[no-any-return]

    def state_dict(self, policy: str) -> dict[str, torch.Tensor]:
        return self.call(_state_dict, policy)

    def target_modules(self, policy: str) -> list[str]:
        if policy not in self._targets:
            self._targets[policy] = self.call(_target_modules, policy)
        return self._targets[policy]

    def release_free_heap(self) -> None:
        self.call(_release_free_heap)

    def close(self) -> None:
        _broadcast(self.group, ("close", self.key))
        self.local = None


def _state_dict(policy: Any, name: str) -> dict[str, torch.Tensor]:
    return policy.state_dict(name)  # type: ignore[no-any-return]


def _target_modules(policy: Any, name: str) -> list[str]:
    return policy.target_modules(name)  # type: ignore[no-any-return]


def _release_free_heap(policy: Any) -> None:
    policy.release_free_heap()


def _build(args: PolicyArgs, group: Group) -> tuple[Any, tuple[str, Any]]:
    try:
        policy = args.build(resolve_device(args.device, group.local_rank))
    except Exception as e:  # noqa: BLE001 - every rank reports; rank 0 fails the run
        log.exception("learner rank %d could not build the policy", group.rank)
        return None, ("error", f"{type(e).__name__}: {e}")
    return policy, ("ok", None)


def _raise_first_error(outcomes: list[tuple[str, Any]]) -> None:
    for rank, (status, value) in enumerate(outcomes):
        if status == "error":
            raise RankFailed(
                f"learner rank {rank} failed: {value} (its traceback is in that rank's log)"
            )


def follow(group: Group) -> None:
    """A follower's life: build, call and drop the policies rank 0 asks for, each run's
    with its own random generators (as `run_lane.RunLane` keeps rank 0's), until rank 0
    says stop or the group breaks."""
    from services.learner.run_lane import _get_rng, _set_rng

    assert group.rank != 0
    heap.keep_freed_heap_until_trimmed(heap.LEARNER_MMAP_THRESHOLD)
    policies: dict[int, Any] = {}
    rngs: dict[int, tuple[Any, ...]] = {}
    while True:
        message = _broadcast(group, None)
        kind, key = message[0], message[1]
        if kind == "stop":
            break
        if kind == "close":
            policies.pop(key, None)
            rngs.pop(key, None)
            heap.release_free_heap()
            continue
        if key in rngs:
            _set_rng(rngs[key])
        if kind == "open":
            policy, outcome = _build(message[2], group)
            if policy is not None:
                policies[key] = policy
        else:
            fn, fargs = message[2], message[3]
            outcome = answer(policies[key], fn, fargs, keep=False)
        rngs[key] = _get_rng()
        _outcomes(group, outcome)
    _leave()


def stop(group: Group) -> None:
    """Rank 0 is stopping: the followers exit (the launcher then ends the group)."""
    if group.rank == 0:
        _broadcast(group, ("stop", 0))
    _leave()


def _leave() -> None:
    """Tear down this rank's process groups while the interpreter is whole. A process
    that exits with gloo's worker threads still alive can abort in its finalization
    (SIGABRT, "terminate called without an active exception"), which the launcher takes
    for a failed rank."""
    global _joined
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    _joined = None
