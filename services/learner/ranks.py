"""The learner's policy held by `learner.world_size` processes, driven from the server.

With one process the policy lives in the learner server itself and
`MultiAdapterPolicy.call(fn, ...)` is `fn(policy, ...)`, or, with
`learner.policy_process: own`, in one process the server spawns (no process group).
With more, the server spawns one process per rank; they form a torch.distributed group
(gloo on the CPU, NCCL with one GPU per rank) and each builds the same policy, its
decoder layers sharded over the group (fsdp.py). `RankedPolicy.call(fn, ...)` sends the
same call to every rank over its pipe, so all ranks run every collective in the
same order, and returns rank 0's result. The server keeps the Runs API,
checkpoints' files and adapter pushes; the ranks hold weights and optimizer
state. A rank that fails or dies fails the call with its rank, pid and exit, and
the other ranks are stopped (they may be waiting for it in a collective).
"""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import os
import signal
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch

from marl.models.devices import resolve_device
from marl.runtime import heap
from marl.runtime.processes import free_port, how_it_ended
from marl.spec.run import LoraSpec, OptimSpec, RunSpec
from services.learner.errors import RunFailed
from services.learner.threads import ThreadBurst

if TYPE_CHECKING:
    from services.learner.policy_pool import PolicyPool

log = logging.getLogger(__name__)

R = TypeVar("R")
START_TIMEOUT_S = 1800.0


class RankFailed(RunFailed):
    """A learner rank raised, or its process died."""


class PolicyHandle(Protocol):
    """What the step loop needs of the policy, wherever its ranks run."""

    policies: list[str]

    def call(self, fn: Callable[..., R], *args: Any) -> R: ...

    def state_dict(self, policy: str) -> dict[str, torch.Tensor]: ...

    def target_modules(self, policy: str) -> list[str]: ...

    def release_free_heap(self) -> None:
        """Hand free heap pages back to the OS (`marl.runtime.heap`) in every process that holds
        the policy and in this one; between updates."""
        ...


@dataclass(frozen=True)
class PolicyArgs:
    """Everything a rank needs to build its copy of the policy."""

    model_path: str
    policies: list[str]
    lora: LoraSpec
    optim: OptimSpec
    total_steps: int
    dtype: str
    seed: int
    device: str

    def build(self, device: str) -> Any:
        """The MultiAdapterPolicy these arguments describe, on `device`."""
        from services.learner.policy import MultiAdapterPolicy

        return MultiAdapterPolicy(
            self.model_path,
            self.policies,
            self.lora,
            self.optim,
            total_steps=self.total_steps,
            dtype=self.dtype,
            seed=self.seed,
            device=device,
        )

    @classmethod
    def of(cls, spec: RunSpec, policies: list[str]) -> PolicyArgs:
        return cls(
            model_path=spec.model.path,
            policies=policies,
            lora=spec.lora,
            optim=spec.optim,
            total_steps=spec.train.steps,
            dtype=spec.model.dtype,
            seed=spec.seed,
            device=spec.learner.device,
        )


def policy_elsewhere(spec: RunSpec) -> bool:
    """Whether `open_policy` puts the run's policy in processes of its own, which leaves
    the server's threads nothing but waiting on them."""
    from services.learner import group

    in_server = spec.learner.world_size == 1 and spec.learner.policy_process == "server"
    return group.joined() is None and not in_server


def open_policy(
    spec: RunSpec, policies: list[str], burst: ThreadBurst | None = None,
    pool: PolicyPool | None = None,
) -> PolicyHandle:
    """The run's policy: on every rank of the group a launcher started this learner in
    (group.py), else in this process, in one of its own (from `pool` when it has one), or
    in `learner.world_size` ranks it spawns. `burst` paces a one-process policy's forwards
    (threads.ThreadBurst)."""
    from services.learner import group

    args = PolicyArgs.of(spec, policies)
    launched = group.joined()
    if launched is not None:
        return group.GroupPolicy.open(args, launched, burst.pace if burst else None)
    if spec.learner.world_size == 1 and spec.learner.policy_process == "server":
        policy = args.build(resolve_device(args.device))
        if burst is not None:
            policy.pace = burst.pace
        return policy  # type: ignore[no-any-return]
    return RankedPolicy.start(args, spec.learner.world_size, burst, pool)


def close_policy(policy: PolicyHandle) -> None:
    from services.learner.group import GroupPolicy

    if isinstance(policy, RankedPolicy | GroupPolicy):
        policy.close()


def _state_dict(policy: Any, name: str) -> dict[str, torch.Tensor]:
    return policy.state_dict(name)  # type: ignore[no-any-return]


def _target_modules(policy: Any, name: str) -> list[str]:
    return policy.target_modules(name)  # type: ignore[no-any-return]


def _release_free_heap(policy: Any) -> None:
    policy.release_free_heap()


def answer(policy: Any, fn: Callable[..., Any], args: tuple[Any, ...], keep: bool) -> tuple[str, Any]:
    """A rank's answer to one call: ("ok", the result, if `keep`: rank 0's is the caller's)
    or ("error", one line; the traceback goes to this rank's log)."""
    try:
        out = fn(policy, *args)
    except BaseException as e:  # noqa: BLE001 - reported to the caller, which fails the run
        traceback.print_exc()
        return "error", f"{type(e).__name__}: {e}"
    return "ok", out if keep else None


def _rank_main(
    rank: int,
    size: int,
    port: int,
    args: PolicyArgs,
    conn: Connection,
    burst: ThreadBurst | None = None,
) -> None:
    import torch.distributed as dist

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when ranks stop
    heap.keep_freed_heap_until_trimmed(heap.LEARNER_MMAP_THRESHOLD)  # as the server does
    try:
        _serve_rank(rank, size, port, args, conn, burst)
    finally:
        if dist.is_initialized():  # gloo's threads end before the interpreter's teardown
            dist.destroy_process_group()


def _serve_rank(
    rank: int,
    size: int,
    port: int,
    args: PolicyArgs,
    conn: Connection,
    burst: ThreadBurst | None,
) -> None:
    import torch.distributed as dist

    try:
        device = resolve_device(args.device, rank)
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        if size > 1:
            dist.init_process_group(
                "nccl" if device.startswith("cuda") else "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=size,
            )
        policy = args.build(device)
        if burst is not None:
            policy.pace = burst.pace
    except BaseException as e:  # noqa: BLE001 - reported to the server, which fails the run
        traceback.print_exc()  # to the learner's log; the run's error gets one line
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ok", None))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            break
        if message is None:
            break
        fn, fargs = message
        conn.send(answer(policy, fn, fargs, keep=rank == 0))


def warm_main(conn: Connection) -> None:
    """A pooled policy process (policy_pool.py): the imports that cost a process its first
    seconds, then run after run the policy each message describes, served until the run
    closes it; None: the process ends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import services.learner.policy  # noqa: F401 - what the pool starts the process for

    while True:
        try:
            args = conn.recv()
        except EOFError:
            return
        if args is None:
            return
        _rank_main(0, 1, 0, args, conn)
        gc.collect()  # the run's policy and optimizer state, before the next run's
        heap.release_free_heap()


class RankedPolicy:
    def __init__(self, policies: list[str], procs: list[Any], conns: list[Connection],
                 pool: PolicyPool | None = None):
        self.policies = policies
        self.procs = procs
        self.conns = conns
        self.pool = pool
        """Where its one process goes back once the policy is closed (policy_pool.py)."""
        self._closed = False
        self._targets: dict[str, list[str]] = {}

    @classmethod
    def start(
        cls, args: PolicyArgs, size: int, burst: ThreadBurst | None = None,
        pool: PolicyPool | None = None,
    ) -> RankedPolicy:
        """`size` processes; with one, a policy apart from the server's process, paced by
        `burst` (which it must inherit: its shared state cannot travel down a pipe), or
        else, with a `pool`, in a process it started before."""
        ctx = mp.get_context("spawn")
        port = free_port()
        procs, conns = [], []
        pooled = pool if size == 1 and burst is None else None
        for _ in range(2 if pooled is not None else 0):
            assert pooled is not None
            proc, conn = pooled.take()
            try:
                conn.send(args)
            except OSError:  # it ended since the pool looked: the next one
                conn.close()
                continue
            procs.append(proc)
            conns.append(conn)
            break
        else:
            pooled = None  # one of its own, as without a pool
        for rank in range(len(procs), size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=_rank_main,
                args=(rank, size, port, args, theirs, burst),
                name=f"marl-learner-rank{rank}",
                daemon=True,
            )
            proc.start()
            theirs.close()
            procs.append(proc)
            conns.append(ours)
        ranks = cls(list(args.policies), procs, conns, pooled)
        try:
            ranks._collect(START_TIMEOUT_S)
        except BaseException:
            ranks.close(kill=True)
            raise
        what = "ranks" if size > 1 else "policy process"
        log.info("learner %s up: %s", what, ", ".join(str(p.pid) for p in procs))
        return ranks

    def call(self, fn: Callable[..., R], *args: Any) -> R:
        """`fn(policy, *args)` on every rank; rank 0's result. `fn` must be importable by
        name (a module-level function) and `args` picklable."""
        for rank, conn in enumerate(self.conns):
            try:
                conn.send((fn, args))
            except OSError:  # it died since the last call
                why = self._exit(rank)
                self.close(kill=True)
                raise RankFailed(why) from None
        return self._collect(None)  # type: ignore[no-any-return]

    def state_dict(self, policy: str) -> dict[str, torch.Tensor]:
        return self.call(_state_dict, policy)

    def release_free_heap(self) -> None:
        self.call(_release_free_heap)
        heap.release_free_heap()

    def target_modules(self, policy: str) -> list[str]:
        if policy not in self._targets:
            self._targets[policy] = self.call(_target_modules, policy)
        return self._targets[policy]

    def _collect(self, timeout: float | None) -> Any:
        """Every rank's answer to the last call; rank 0's result. The first failure
        stops all ranks: the others may be blocked in a collective with the failed one."""
        results: dict[int, Any] = {}
        waiting = dict(enumerate(self.conns))
        while waiting:
            sentinels = {self.procs[r].sentinel: r for r in waiting}
            ready = wait([*waiting.values(), *sentinels], timeout)
            if not ready:
                self.close(kill=True)
                raise RankFailed(f"learner ranks did not answer within {timeout:.0f} s")
            for item in ready:
                if item in sentinels:
                    rank = sentinels[item]
                    if self.conns[rank].poll():
                        continue  # its answer is waiting; read it first
                    why = self._exit(rank)
                    self.close(kill=True)
                    raise RankFailed(why)
                rank = next(r for r, c in waiting.items() if c is item)
                try:
                    status, value = self.conns[rank].recv()
                except (EOFError, OSError):  # closed, or reset by a killed process
                    why = self._exit(rank)
                    self.close(kill=True)
                    raise RankFailed(why) from None
                del waiting[rank]
                if status == "error":
                    self.close(kill=True)
                    raise RankFailed(
                        f"{self._name(rank)} failed: {value} (its traceback is in the "
                        "learner's log)"
                    )
                results[rank] = value
        return results.get(0)

    def _exit(self, rank: int) -> str:
        proc = self.procs[rank]
        proc.join(5)
        return f"{self._name(rank)} (pid {proc.pid}) {how_it_ended(proc.exitcode)}"

    def _name(self, rank: int) -> str:
        return f"learner rank {rank}" if len(self.procs) > 1 else "learner policy process"

    def close(self, kill: bool = False) -> None:
        """Stop every rank: asked to when `kill` is False, else at once (after a failure,
        when the others may be blocked in a collective that will never complete). Once."""
        if self._closed:
            return
        self._closed = True
        for conn in self.conns:
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
        if self.pool is not None and not kill:
            self.pool.give_back((self.procs[0], self.conns[0]))
            return
        for proc in self.procs:
            proc.join(0 if kill else 10)
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(5)
        for conn in self.conns:
            conn.close()
