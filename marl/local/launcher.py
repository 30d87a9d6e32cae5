"""Start every marl service as its own process on loopback, and stop them cleanly.

Used by `marl demo`, `marl up` and the integration tests: a private Redis (or
the one given), then inference, sandbox, workflow and learner processes, each
waited on until its health check reports SERVING. Inference and sandbox also get
an HTTP port (OpenAI `/v1`, SandboxFusion `/run_code`), listed in endpoints.json
as `inference_http` and `sandbox_http`; every service's Prometheus scrape URL is under
`metrics` (`{"learner": ["http://HOST:PORT/metrics"], ...}`).

The sandbox holds its own token, never the services' (`sandbox_environment`): with
`$MARL_SANDBOX_TOKEN` (or `_FILE`) set, the sandbox and the workflow workers get it; with
only `$MARL_AUTH_TOKEN` set, the cluster makes one (`<workdir>/sandbox-token`, mode 0600,
listed as `sandbox_token_file` in endpoints.json for `marl sandbox run`). The learner and
inference get no sandbox token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marl.local.redis_server import PrivateRedis
from marl.runtime.processes import die_with_parent, free_port, how_it_ended
from marl.runtime.serving import wait_healthy
from marl.spec.services import (
    SANDBOX_TOKEN_ENV,
    SANDBOX_TOKEN_FILE_ENV,
    auth_token,
    sandbox_token,
)

HTTP_SERVICES = ("inference", "sandbox", "workflow", "learner")
"""Services started with an HTTP port too (OpenAI /v1, SandboxFusion /run_code; every
one's Prometheus /metrics)."""
DEFAULT_CORES = 2
"""Cores a machine's services share out unless told otherwise (the demo's 2-core target)."""
OMP_SPIN_COUNT = 10_000
"""Spins an idle OpenMP thread of a service waits for more work before it sleeps (libgomp's
own default is 300,000). A short spin spares a synchronous update a futex wake-up per
small operator, which makes it faster than sleeping at once (`OMP_WAIT_POLICY=PASSIVE`);
but learner and inference overlapped on the same cores (`train.max_staleness` 1) spin on
each other's and run slower than asleep, so overlapped services share the cores out
(`Cluster.threads`) and their pools never spin on one another's cores. `bench/vs_trl.py`
(`--max-staleness`, `--learner-threads`, `--inference-threads`) measures both."""


def service_threads(cores: int, overlapped: bool) -> dict[str, int]:
    """Threads per service kind for runs on `cores` cores. A synchronous run
    (`train.max_staleness` 0) generates, then trains: the learner gets every core for its
    update, and the inference replica every core but one, which the workflow workers
    (one thread each) keep busy while it decodes: a replica pool over every core spins on
    theirs. An overlapped run
    (>= 1) generates and trains at once: they get disjoint shares, so that neither's
    OpenMP pool spins on the other's cores (OMP_SPIN_COUNT). `learner_burst`: the threads
    the learner's update takes once every rollout queued ahead is in and the inference
    share idles (`services.learner.threads`): every core."""
    if overlapped:
        inference, learner = max(1, cores // 2), max(1, cores - cores // 2)
    else:
        inference, learner = max(1, cores - 1), max(1, cores)
    return {"inference": inference, "learner": learner, "learner_burst": max(1, cores),
            "workflow": 1, "sandbox": 1}


_OTHER_SERVICES_PREFIXES = ("MARL_AUTH_", "MARL_INFERENCE_", "MARL_WORKFLOW_",
                            "MARL_LEARNER_")


def sandbox_environment(env: dict[str, str]) -> dict[str, str]:
    """`env` without what the sandbox must not hold: the services' token and the users'
    file (`MARL_AUTH_*`), and the other services' settings (a Redis URL carries the
    password). Code that escapes a job can read what the sandbox's process holds."""
    return {k: v for k, v in env.items() if not k.startswith(_OTHER_SERVICES_PREFIXES)}


@dataclass
class Process:
    kind: str
    address: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    http_address: str | None = None
    """HTTP front end (inference: OpenAI /v1; sandbox: SandboxFusion /run_code)."""
    args: list[str] = field(default_factory=list)
    """The `marl serve KIND` arguments after --port (and --http-port): a restart reuses them."""
    launch: list[str] = field(default_factory=list)
    """torchrun's arguments when torch's launcher starts the service (a learner node)."""

    def exit_description(self) -> str | None:
        """None while it runs; else which service ended, how, and where its log is."""
        code = self.proc.poll()
        if code is None:
            return None
        return (
            f"the {self.kind} service (pid {self.proc.pid}) {how_it_ended(code)}; "
            f"its log: {self.log_path}"
        )


LEARNER_NODE_RESTARTS = 100
"""How often a learner node's agent restarts its rank: each time the group breaks (a node
lost) counts one."""


def torchrun_args(nodes: int, node: int, rendezvous_port: int) -> list[str]:
    """torchrun's arguments for learner node `node` of `nodes` on this machine, one rank
    each, meeting at torch's c10d rendezvous on loopback. The first node hosts the
    rendezvous store; the others may die and be started again."""
    return [
        "--nnodes", str(nodes), "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{rendezvous_port}",
        "--rdzv-id", "marl-learner", "--rdzv-conf", f"is_host={node == 0}",
        "--max-restarts", str(LEARNER_NODE_RESTARTS), "--monitor-interval", "1",
    ]


@dataclass
class Cluster:
    workdir: Path
    model_path: str
    engine: str = "transformers"
    redis_url: str | None = None
    inference_replicas: int = 1
    workflow_replicas: int = 1
    sandbox_replicas: int = 1
    learner: bool = True
    learner_replicas: int = 1
    """Learner processes; they take runs from one queue in Redis (services/learner/runs.py),
    so runs beyond one learner's `max_concurrent_runs` train in another process, on a
    torch thread of their own."""
    max_lora_rank: int | None = None
    """The largest LoRA rank the replicas take (None: the inference config's)."""
    max_loras: int | None = None
    """vLLM's LoRA slots per batch (None: the inference config's); for a cluster started
    for known runs, `adapter_versions_in_flight` of each. The transformers engine has no
    such limit."""
    max_concurrent_runs: int | None = None
    """Runs the learner trains at once (None: the learner config's)."""
    learner_nodes: int = 1
    """Above 1: the learner is one group of this many "nodes", each a torchrun agent with
    one rank, rendezvousing over TCP on loopback as machines of a cluster do
    (services/learner/group.py). Rank 0 serves the Runs API; the group shares the learner's
    threads. An agent restarts its rank when the group breaks (`--max-restarts`), and
    `restart` starts a dead node again, which rejoins the group."""
    threads: dict[str, int] = field(
        default_factory=lambda: service_threads(DEFAULT_CORES, overlapped=False)
    )
    """Torch/OpenMP threads per service kind (`service_threads`)."""
    processes: list[Process] = field(default_factory=list)
    redis: PrivateRedis | None = None
    redis_aof: bool = False
    """The private Redis (when `redis_url` is not given) logs every write to an append-only
    file (fsync every second): a Redis killed and restarted keeps what it acknowledged."""
    trace_dir: Path | None = None
    """Where the services write their trace spans (`marl serve --trace-dir`, marl.runtime.tracing)."""
    traced: tuple[str, ...] | None = None
    """The service kinds that trace into `trace_dir` (None: every one). Each span costs its
    service a line written; a worker writes two an episode."""
    sandbox_token_file: Path | None = None
    """The sandbox's token this cluster made (authentication on, no `$MARL_SANDBOX_TOKEN`
    given); set by `start`."""
    allowed_modules: tuple[str, ...] | None = None
    """Module prefixes whose workflows and reward functions the learner and the workers
    take (`allowed_modules`); None: the modules of the current directory, since the user
    who starts a local cluster there is its operator (`marl.spec.code_refs`)."""
    path_roots: tuple[str, ...] = ("/",)
    """The learner's `out_dir_roots`, `model_roots` and `data_roots`: on a local cluster any
    directory its user can reach (a run still never writes into another run's directory)."""
    judge_endpoints: tuple[str, ...] | None = None
    """Judge endpoints the learner and the workers allow (None: their config's)."""

    def _trust_args(self, kind: str) -> list[str]:
        """What the operator lets a run spec name, as `marl serve` flags."""
        from marl.spec.code_refs import local_modules

        if kind not in ("learner", "workflow"):
            return []
        modules = local_modules() if self.allowed_modules is None else self.allowed_modules
        args = ["--allowed-modules", ",".join(modules)] if modules else []
        if self.judge_endpoints:
            args += ["--judge-endpoints", ",".join(self.judge_endpoints)]
        if kind == "learner" and self.path_roots:
            roots = ",".join(self.path_roots)
            args += ["--out-dir-roots", roots, "--model-roots", roots, "--data-roots", roots]
        return args

    def _spawn(
        self,
        kind: str,
        args: list[str],
        port: int | None = None,
        http_port: int | None = None,
        log_path: Path | None = None,
        launch: list[str] | None = None,
    ) -> Process:
        port = port or free_port()
        if kind in HTTP_SERVICES:
            http_port = http_port or free_port()
        extra = args if http_port is None else [*args, "--http-port", str(http_port)]
        logs = self.workdir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        n = sum(p.kind == kind for p in self.processes)
        log_path = log_path or logs / f"{kind}-{n}.log"
        env = dict(os.environ)
        share = self.learner_nodes if launch else 1  # the nodes share the learner's cores
        threads = str(max(1, self.threads.get(kind, 1) // share))
        env.update(
            OMP_NUM_THREADS=threads,
            MKL_NUM_THREADS=threads,
            # idle OpenMP threads spin briefly, then sleep (see OMP_SPIN_COUNT)
            GOMP_SPINCOUNT=str(OMP_SPIN_COUNT),
            TOKENIZERS_PARALLELISM="false",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            PYTHONUNBUFFERED="1",
            # the service stops once this process is gone (marl.serving.StopWatchdog)
            MARL_PARENT_PID=str(os.getpid()),
        )
        if kind == "sandbox":
            env = sandbox_environment(env)
        if kind not in ("sandbox", "workflow"):  # only the sandbox and its clients hold it
            env.pop(SANDBOX_TOKEN_ENV, None)
            env.pop(SANDBOX_TOKEN_FILE_ENV, None)
        elif self.sandbox_token_file is not None:
            env[SANDBOX_TOKEN_FILE_ENV] = str(self.sandbox_token_file)
        if kind == "learner" and "learner_burst" in self.threads:
            env["MARL_LEARNER_BURST_THREADS"] = str(self.threads["learner_burst"])
        if self.trace_dir is not None and (self.traced is None or kind in self.traced):
            extra = [*extra, "--trace-dir", str(self.trace_dir)]
        extra = [*extra, *self._trust_args(kind)]
        cmd = [sys.executable, "-m", "marl.cli", "serve", kind, "--port", str(port), *extra]
        if launch:
            # the ranks' parent is torchrun's agent, which dies with this process
            del env["MARL_PARENT_PID"]
            cmd = [sys.executable, "-m", "torch.distributed.run", *launch, *cmd[1:]]
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                die_with_parent(cmd),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        http = None if http_port is None else f"127.0.0.1:{http_port}"
        p = Process(kind, f"127.0.0.1:{port}", proc, log_path, http, list(args), list(launch or []))
        self.processes.append(p)
        return p

    def restart(self, dead: Process) -> Process:
        """Start a service that exited again, on its ports and with its arguments (its
        clients' addresses stay valid; a learner takes its runs over), logging to the same
        file; returns once it is SERVING."""
        index = self.processes.index(dead)
        self.processes.remove(dead)
        port = int(dead.address.rsplit(":", 1)[1])
        http_port = int(dead.http_address.rsplit(":", 1)[1]) if dead.http_address else None
        p = self._spawn(dead.kind, dead.args, port, http_port, dead.log_path, dead.launch)
        self.processes.insert(index, self.processes.pop())
        asyncio.run(self._wait([p], 300.0))
        return p

    def restart_redis(self) -> bool:
        """Start the private Redis again if it died (on its port and workdir, so with AOF
        it comes back with what it had); False when it is alive or not ours."""
        if self.redis is None or self.redis.proc is None or self.redis.proc.poll() is None:
            return False
        self.redis.start()
        return True

    def start(self, timeout_s: float = 300.0) -> dict[str, Any]:
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.redis_url is None:
            self.redis = PrivateRedis(
                workdir=str(self.workdir / "redis"), aof=self.redis_aof
            ).start()
            self.redis_url = self.redis.url
        redis_args = ["--redis", self.redis_url]
        self._make_sandbox_token()
        for _ in range(self.sandbox_replicas):
            self._spawn("sandbox", [])
        sandbox = [p.address for p in self.processes if p.kind == "sandbox"]
        for _ in range(self.inference_replicas):
            self._spawn("inference", self._inference_args())
        for i in range(self.workflow_replicas):
            extra = ["--sandbox", sandbox[i % len(sandbox)]] if sandbox else []
            self._spawn("workflow", [*redis_args, *extra])
        if self.learner:
            runs = () if self.max_concurrent_runs is None else (
                "--max-concurrent-runs", str(self.max_concurrent_runs)
            )
            args = [*redis_args, "--runs-dir", str(self.workdir / "runs"), *runs]
            for _ in range(self.learner_replicas):
                if self.learner_nodes == 1:
                    self._spawn("learner", args)
                    continue
                port, http_port, rendezvous = free_port(), free_port(), free_port()
                for node in range(self.learner_nodes):
                    self._spawn(
                        "learner", args, port, http_port,
                        launch=torchrun_args(self.learner_nodes, node, rendezvous),
                    )
        try:
            asyncio.run(self._wait(self.processes, timeout_s))
        except BaseException:
            self.stop()
            raise
        return self.endpoints()

    def _make_sandbox_token(self) -> None:
        """With authentication on and no sandbox token given, a new one for this cluster's
        sandbox and workers (kept across restarts of the cluster in the same workdir)."""
        if sandbox_token() is not None or auth_token() is None:
            return
        path = self.workdir / "sandbox-token"
        if not path.is_file():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(32))
        self.sandbox_token_file = path

    def _inference_args(self) -> list[str]:
        assert self.redis_url is not None
        return [
            *("--redis", self.redis_url, "--model", self.model_path, "--engine", self.engine),
            *(() if self.max_lora_rank is None else ("--max-lora-rank", str(self.max_lora_rank))),
            *(() if self.max_loras is None else ("--max-loras", str(self.max_loras))),
        ]

    def add_inference_replica(self, wait: bool = True, timeout_s: float = 300.0) -> Process:
        """Start one more inference replica in the running cluster (one that joins mid-run);
        with `wait`, return once it reports SERVING, i.e. holds every current adapter."""
        return self.add("inference", self._inference_args(), wait, timeout_s)

    def learner_args(self) -> list[str]:
        """The `marl serve learner` arguments of this cluster's learners (a replacement's)."""
        assert self.redis_url is not None
        return ["--redis", self.redis_url, "--runs-dir", str(self.workdir / "runs")]

    def add(
        self, kind: str, args: list[str], wait: bool = True, timeout_s: float = 300.0
    ) -> Process:
        """Start one more `kind` service (`marl serve KIND ARGS`) in the running cluster, on
        new ports: one that joins mid-run or replaces a killed one. With `wait`, return once
        it reports SERVING; else `wait_serving` waits on it."""
        p = self._spawn(kind, args)
        if wait:
            self.wait_serving([p], timeout_s)
        return p

    def wait_serving(self, processes: list[Process], timeout_s: float = 300.0) -> None:
        """Return once every one of `processes` reports SERVING; raise with its log's tail
        if one exits first."""
        asyncio.run(self._wait(processes, timeout_s))

    def kill(self, p: Process, sig: int = signal.SIGKILL, forget: bool = True) -> int:
        """Send `sig` to the service's process group and wait for it to exit; returns its
        exit code. With `forget` it leaves `processes` (a replacement is `add`ed); without,
        it stays there for `restart`."""
        os.killpg(p.proc.pid, sig)
        code = p.proc.wait(timeout=60)
        if forget:
            self.processes.remove(p)
        return code

    async def _wait(self, processes: list[Process], timeout_s: float) -> None:
        async def one(p: Process) -> None:
            waiter = asyncio.create_task(wait_healthy(p.address, timeout_s))
            while not waiter.done():
                if p.proc.poll() is not None:
                    waiter.cancel()
                    tail = p.log_path.read_text()[-3000:]
                    raise RuntimeError(f"{p.kind} exited with {p.proc.returncode}:\n{tail}")
                await asyncio.sleep(0.2)
            await waiter

        await asyncio.gather(*(one(p) for p in processes))

    def dead(self) -> list[Process]:
        """The services that have exited (none should while the cluster runs)."""
        return [p for p in self.processes if p.proc.poll() is not None]

    def pids_by_kind(self) -> dict[str, list[int]]:
        """The cluster's processes by kind (inference, workflow, learner, sandbox, redis)."""
        pids: dict[str, list[int]] = {}
        for p in self.processes:
            pids.setdefault(p.kind, []).append(p.proc.pid)
        if self.redis is not None and self.redis.proc is not None:
            pids["redis"] = [self.redis.proc.pid]
        return pids

    def endpoints(self) -> dict[str, Any]:
        def of(kind: str) -> list[str]:
            return [p.address for p in self.processes if p.kind == kind]

        return {
            "learner": next(iter(of("learner")), None),
            "inference": of("inference"),
            "sandbox": of("sandbox"),
            "workflow": of("workflow"),
            "inference_http": [
                p.http_address for p in self.processes if p.kind == "inference" and p.http_address
            ],
            "sandbox_http": [
                p.http_address for p in self.processes if p.kind == "sandbox" and p.http_address
            ],
            "workflow_http": [
                p.http_address for p in self.processes if p.kind == "workflow" and p.http_address
            ],
            "learner_http": [
                p.http_address for p in self.processes if p.kind == "learner" and p.http_address
            ],
            "metrics": {
                kind: [f"http://{p.http_address}/metrics" for p in self.processes
                       if p.kind == kind and p.http_address]
                for kind in ("learner", "inference", "workflow", "sandbox")
            },
            "redis": self.redis_url,
            "sandbox_token_file": (None if self.sandbox_token_file is None
                                   else str(self.sandbox_token_file)),
            "pids": {
                k: [p.proc.pid for p in self.processes if p.kind == k]
                for k in ("learner", "inference", "workflow", "sandbox")
            },
        }

    def write_endpoints(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.endpoints(), indent=2))
        os.replace(tmp, path)

    def dump_stacks(self, settle_s: float = 2.0) -> Path:
        """Have every running service write its threads' and asyncio tasks' stacks to its
        log (SIGUSR1, SIGUSR2): what a hung run was waiting on. Returns the logs directory
        once they had `settle_s` to write."""
        for p in self.processes:
            if p.proc.poll() is None:
                for sig in (signal.SIGUSR1, signal.SIGUSR2):
                    with contextlib.suppress(ProcessLookupError):
                        p.proc.send_signal(sig)
        time.sleep(settle_s)
        return self.workdir / "logs"

    def stop(self, grace_s: float = 10.0) -> None:
        for p in self.processes:
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in self.processes:
            try:
                p.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.proc.pid, signal.SIGKILL)
                p.proc.wait()
        self.processes.clear()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
