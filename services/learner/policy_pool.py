"""Policy processes that outlive their runs (`learner.policy_process: own`).

A policy process spends its first seconds importing torch, transformers and peft. On the
demo model that is most of what a short run costs in it: paid again by every run, and by
runs started at once on the same cores all together. The pool starts
`learner.warm_policy_processes` of them with the learner. A run takes an idle one, or one
started for it (`RankedPolicy.start`); once the run closes its policy the process drops it
and waits for the next run's (`ranks.warm_main`), unless that many are idle already, when
it ends.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

log = logging.getLogger(__name__)

Worker = tuple[BaseProcess, Connection]


class PolicyPool:
    def __init__(self, idle: int):
        self.idle = idle
        """The most processes kept waiting for a run."""
        self._idle: list[Worker] = []
        self._lock = threading.Lock()
        """`take` and `give_back` run on the runs' torch threads, `close` on the loop's."""
        self._closed = False
        for _ in range(idle):
            self._idle.append(self._start())

    @staticmethod
    def _start() -> Worker:
        from services.learner.ranks import warm_main

        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=warm_main, args=(theirs,), name="marl-learner-policy",
                           daemon=True)
        proc.start()
        theirs.close()
        return proc, ours

    def take(self) -> Worker:
        """An idle process, still alive; else one started now."""
        with self._lock:
            while self._idle:
                proc, conn = self._idle.pop()
                if proc.is_alive():
                    return proc, conn
                log.warning("idle policy process %s had ended (exit code %s)", proc.pid,
                            proc.exitcode)
                conn.close()
        return self._start()

    def give_back(self, worker: Worker) -> None:
        """A process whose run closed its policy: kept for the next run, or ended when
        the pool is closed or has `idle` waiting already."""
        with self._lock:
            if any(proc is worker[0] for proc, _ in self._idle):
                return  # given back already (a policy closed twice)
            if not self._closed and len(self._idle) < self.idle and worker[0].is_alive():
                self._idle.append(worker)
                return
        _end([worker])

    def close(self) -> None:
        """End the idle processes; those still in runs end as their runs give them back."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        _end(idle)


def _end(workers: list[Worker]) -> None:
    for _, conn in workers:
        try:
            conn.send(None)
        except (OSError, ValueError):
            pass
    for proc, conn in workers:
        proc.join(5)
        if proc.is_alive() and proc.pid is not None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(5)
        conn.close()
