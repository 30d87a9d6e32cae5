"""Sandbox benchmark: trivial jobs with full isolation vs bare `python -c` runs.

A trivial job is `print(1)` with one stdin/stdout test. Measured in the same
run, interleaved in rounds so background load hits both sides alike:

- baseline: `subprocess.run([python, "-c", "print(1)"])`, the cheapest way a
  grader can run code in a fresh process (no isolation, no verdict);
- sandbox: the same program through `marl serve sandbox` (a real server
  process, gRPC, the strongest tier the kernel allows, verdict included);
- sandbox over HTTP: the same server's SandboxFusion `POST /run_code` (one
  keep-alive connection per worker thread), the same jails and limits.

Throughput runs `--workers` jobs at a time on both sides (the same number for
the baseline and the sandbox); latency runs one at a time, and the isolation
overhead per job is the sandbox's median latency minus the baseline's. A
second server started with `isolation: rlimits` shows what the namespace and
seccomp layers add on top of the jail's floor. Prints a table, then one JSON
object as the very last line.

Load: 4 jobs in flight by default. Until issue 18 this bench kept 2 in flight,
which on a 2-core machine leaves a core idle during every client round trip
(the client waits for a verdict before it sends the next job) and so measured
the load generator as much as the server. A trainer sends a whole group of
completions at once (4 to 8 per problem at the paper's group sizes), so 4 in
flight is the lighter end of real use; `--workers 2` gives the old setting.

    python bench/sandbox.py [--jobs 400] [--workers 4]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from host import describe, host
from snapshot import add_save_option, emit

from marl.clients import SandboxClient
from marl.runtime.processes import free_port
from marl.runtime.serving import wait_healthy

ROOT = Path(__file__).resolve().parent.parent
TRIVIAL = "print(1)"
TEST = [{"stdin": "", "expected_stdout": "1"}]



@contextmanager
def sandbox_server(isolation: str) -> Iterator[tuple[str, int]]:
    """The server's gRPC address and its HTTP (SandboxFusion) port."""
    port, http_port = free_port(), free_port()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "sandbox.yaml"
        config.write_text(f"isolation: {isolation}\nmax_concurrency: 4\n")
        env = {k: v for k, v in os.environ.items() if k != "MARL_SANDBOX_SABOTAGE"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.reward_sandbox.server", "--port", str(port),
             "--http-port", str(http_port), "--config", str(config)], cwd=ROOT, env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        address = f"127.0.0.1:{port}"
        try:
            asyncio.run(wait_healthy(address, timeout=60))
            yield address, http_port
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def bare_job() -> None:
    out = subprocess.run([sys.executable, "-c", TRIVIAL], capture_output=True, check=True)
    assert out.stdout.strip() == b"1"


def sandbox_job(client: SandboxClient) -> Callable[[], None]:
    def job() -> None:
        result = client.execute(TRIVIAL, TEST)
        assert result.verdicts == ["PASSED"], result

    return job


def http_job(port: int) -> Callable[[], None]:
    """A trivial job through POST /run_code, on this thread's keep-alive connection."""
    local = threading.local()
    body = json.dumps({"code": TRIVIAL, "language": "python", "stdin": ""})

    def job() -> None:
        if not hasattr(local, "conn"):
            local.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        local.conn.request("POST", "/run_code", body, {"Content-Type": "application/json"})
        reply = local.conn.getresponse()
        result = json.loads(reply.read())
        assert reply.status == 200 and result["run_result"]["stdout"] == "1\n", result

    return job


def throughput(job: Callable[[], None], n: int, workers: int) -> float:
    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        for f in [pool.submit(job) for _ in range(n)]:
            f.result()
    return n / (time.perf_counter() - start)


def latency_ms(job: Callable[[], None], n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        job()
        out.append((time.perf_counter() - start) * 1000)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=400, help="jobs per side per measurement")
    parser.add_argument("--workers", type=int, default=4, help="jobs in flight")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds")
    add_save_option(parser)
    args = parser.parse_args()
    per_round = max(1, args.jobs // args.rounds)

    bare_tp: list[float] = []
    sand_tp: list[float] = []
    bare_lat: list[float] = []
    sand_lat: list[float] = []
    floor_lat: list[float] = []
    http_tp: list[float] = []
    http_lat: list[float] = []
    with sandbox_server("auto") as (full, http_port), sandbox_server("rlimits") as (floor, _):
        with SandboxClient(full) as client, SandboxClient(floor) as floor_client:
            tier = client.info()["isolation_tier"]
            over_http = http_job(http_port)
            for _ in range(10):  # warm up every side
                bare_job()
                sandbox_job(client)()
                sandbox_job(floor_client)()
                over_http()
            for _ in range(args.rounds):
                bare_tp.append(throughput(bare_job, per_round, args.workers))
                sand_tp.append(throughput(sandbox_job(client), per_round, args.workers))
                http_tp.append(throughput(over_http, per_round, args.workers))
                bare_lat += latency_ms(bare_job, per_round // 2)
                sand_lat += latency_ms(sandbox_job(client), per_round // 2)
                http_lat += latency_ms(over_http, per_round // 2)
                floor_lat += latency_ms(sandbox_job(floor_client), per_round // 2)

    bare_rate, sand_rate = statistics.median(bare_tp), statistics.median(sand_tp)
    bare_ms, sand_ms = statistics.median(bare_lat), statistics.median(sand_lat)
    floor_ms = statistics.median(floor_lat)
    http_rate, http_ms = statistics.median(http_tp), statistics.median(http_lat)
    facts = host()
    cores = facts["cores"]  # what `taskset` leaves this run, not the machine's
    rows: list[tuple[str, float | None, float]] = [
        ("bare `python -c` subprocess", bare_rate, bare_ms),
        (f"sandbox, tier {tier}, via gRPC", sand_rate, sand_ms),
        (f"sandbox, tier {tier}, via HTTP run_code", http_rate, http_ms),
        ("sandbox, tier rlimits, via gRPC", None, floor_ms),  # its latency alone is timed
    ]
    print(f"trivial jobs, {cores} cores, {args.workers} in flight, "
          f"{per_round * args.rounds} jobs per side")
    print(f"{'':44s} {'jobs/s':>9s} {'p50 ms (1 in flight)':>22s}")
    for name, rate, ms in rows:
        shown = "not run" if rate is None else f"{rate:.1f}"
        print(f"{name:44s} {shown:>9s} {ms:22.2f}")
    print(f"throughput ratio sandbox/bare: {sand_rate / bare_rate:.2f}x")
    print(f"isolation overhead per job vs bare python -c: {sand_ms - bare_ms:+.2f} ms")
    print(f"namespaces+seccomp on top of the rlimits tier: {sand_ms - floor_ms:+.2f} ms")
    print(f"HTTP (SandboxFusion) vs gRPC throughput: {http_rate / sand_rate:.2f}x")
    print(describe(facts))
    emit({
        "host": facts, "tier": tier, "cores": cores, "workers": args.workers,
        "bare_jobs_per_s": round(bare_rate, 1), "sandbox_jobs_per_s": round(sand_rate, 1),
        "ratio_vs_bare": round(sand_rate / bare_rate, 3),
        "bare_p50_ms": round(bare_ms, 2), "sandbox_p50_ms": round(sand_ms, 2),
        "overhead_ms_per_job": round(sand_ms - bare_ms, 2),
        "rlimits_tier_p50_ms": round(floor_ms, 2),
        "namespace_seccomp_cost_ms": round(sand_ms - floor_ms, 2),
        "http_jobs_per_s": round(http_rate, 1), "http_p50_ms": round(http_ms, 2),
        "http_vs_grpc_ratio": round(http_rate / sand_rate, 3),
    }, args.save)


if __name__ == "__main__":
    main()
