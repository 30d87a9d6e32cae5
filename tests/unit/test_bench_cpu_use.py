"""bench/cpu_use.py, the benches' CPU accounting: a service's children count, living or reaped."""

from __future__ import annotations

import subprocess
import sys

from cpu_use import cpu_seconds

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"
PARENT = (
    "import subprocess, sys, time\n"
    "reaped = subprocess.run([sys.executable, '-c', {reaped!r}])\n"
    "alive = subprocess.Popen([sys.executable, '-c', {alive!r}])\n"
    "print('ready', flush=True)\n"
    "time.sleep(30)\n"
)


def test_cpu_seconds_counts_reaped_and_living_descendants() -> None:
    alive = BURN.format(s=0.4) + "print('burnt', flush=True)\ntime.sleep(30)\n"
    code = PARENT.format(reaped=BURN.format(s=0.4), alive=alive)
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None
        assert [parent.stdout.readline() for _ in range(2)] == [b"ready\n", b"burnt\n"]
        total = cpu_seconds([parent.pid])
        # the reaped child's 0.4 s (in the parent's cutime) and the living child's 0.4 s,
        # with three interpreters' start-up
        assert 0.8 <= total < 2.0, total
        assert cpu_seconds([parent.pid + 10_000_000]) == 0.0  # no such process
    finally:
        parent.kill()
        parent.wait()
