"""`marl demo` and `marl up`: the whole system on one machine, every service its own process."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from marl.models import names as model_names
from marl.models.engines import resolve_engine, vllm_available
from marl.spec.run import apply_overrides, dump_spec, parse_spec
from marl.spec.services import LearnerConfig

DEMO_SPEC: dict[str, Any] = {
    "name": "demo",
    "workflow": "voting",
    "policy": "shared",
    "engine": "transformers",
    "lora": {"rank": 16, "alpha": 32},
    "optim": {"lr": 1e-3, "warmup_steps": 0, "schedule": "constant"},
    "grpo": {"group_size": 8, "mini_batch_size": 16, "micro_batch_sequences": 128},
    "train": {
        "steps": 40,
        "problems_per_step": 16,
        "val_interval": 10,
        "val_problems": 200,
        "checkpoint_interval": 20,
        "step_timeout_s": 300,
    },
    "sampling": {"temperature": 1.0, "max_tokens": 8},
    "data": {"train": "arithmetic", "val": "arithmetic"},
}
"""The paper's defaults scaled to a 0.5M-parameter model on 2 cores."""


FILE_SET = "dapo_math"
"""The math set read from a file: its published schema, verl's, or plain prompt/answer
columns (marl.data)."""


def own_data(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`marl demo data.train_path=FILE`: train on FILE and validate on the share of it held
    out (`data.val_fraction`), instead of the demo's bundled arithmetic, which reads no
    file. What the user names (`data.train`, `data.val`, `data.val_path`) stays."""
    keys = {item.partition("=")[0].strip() for item in overrides}
    if not data.get("train_path") or "data.train" in keys:
        return data
    out = {**data, "train": FILE_SET}
    if not keys & {"data.val", "data.val_path"}:
        out["val"] = FILE_SET
    return out


def demo_model() -> Path:
    from marl.models.demo import demo_model_dir

    return demo_model_dir()


def run_demo(  # noqa: PLR0915 (older than the limit; split it when next changed)
    out: str | None, steps: int | None, overrides: list[str], trace: bool = False
) -> int:
    """`trace`: every service traces its spans into OUT/trace (marl.runtime.tracing), and the run
    ends with where each step's time went and OUT/trace.json."""
    from marl.local.launcher import DEFAULT_CORES, Cluster, service_threads
    from marl.monitor.progress import follow_run
    from marl.protocol.v1 import learner_pb2, learner_pb2_grpc
    from marl.spec.errors import UserError
    from marl.workflows.routing import adapter_versions_in_flight

    # a named model's own demo settings (`model.path=smollm2`: longer turns, smaller
    # steps), then the user's overrides over them
    data = apply_overrides(DEMO_SPEC, [*model_names.demo_overrides(overrides), *overrides])
    data["data"] = own_data(data["data"], overrides)
    if steps is not None:
        data["train"]["steps"] = steps
    spec = parse_spec(data)
    out_dir = Path(out or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    if (out_dir / "metrics.jsonl").exists():
        raise UserError(f"--out: {out_dir} already holds a run; choose another directory")
    started = time.monotonic()
    engine = resolve_engine(spec.engine)
    if engine == "vllm" and not vllm_available():
        raise UserError(
            "engine=vllm: the vllm package is not installed in this environment; "
            "run scripts/setup_vllm_env.sh and start marl from .venv-vllm "
            "(.venv-vllm/bin/marl demo engine=vllm), or use engine=transformers"
        )
    if "model.path" not in " ".join(overrides):
        spec.model.path = str(demo_model())
    try:
        spec.model.path = model_names.resolve(spec.model.path)
    except ValueError as err:
        raise UserError(str(err)) from None
    spec.out_dir = str(out_dir)
    print(
        f"marl demo: {spec.workflow} workflow, {spec.policy} policy, {engine} engine, "
        f"{spec.train.steps} steps -> {out_dir}"
    )
    cluster = Cluster(
        out_dir / "cluster",
        spec.model.path,
        engine=engine,
        sandbox_replicas=int(os.environ.get("MARL_DEMO_SANDBOXES", "1")),
        max_lora_rank=spec.lora.rank,
        max_loras=adapter_versions_in_flight(spec),
        threads=service_threads(DEFAULT_CORES, overlapped=spec.train.max_staleness > 0),
        trace_dir=out_dir / "trace" if trace else None,
    )
    endpoints = cluster.start()
    print(
        f"services up in {time.monotonic() - started:.0f}s: "
        + ", ".join(f"{k} pid {v}" for k, v in endpoints["pids"].items())
    )
    import grpc

    from marl.runtime import auth

    stub = learner_pb2_grpc.LearnerStub(auth.channel(endpoints["learner"]))
    watched = _WatchedStub(stub)
    watchdog = _Watchdog(cluster, watched)
    watchdog.start()
    try:
        run_id = stub.SubmitRun(
            learner_pb2.SubmitRunRequest(spec_yaml=dump_spec(spec)), timeout=120
        ).run_id
        print(f"run {run_id}")
        state = follow_run(watched, run_id)
        run = stub.GetRun(learner_pb2.GetRunRequest(run_id=run_id), timeout=30)
    except grpc.RpcError as err:
        watchdog.stop()
        died = watchdog.died or [d for p in cluster.dead() if (d := p.exit_description())]
        if died:
            print("marl demo: a service died; the run cannot go on:")
            for line in died:
                print(f"  {line}")
            return 1
        print(f"marl demo: lost the learner: {err.code().name}: {err.details()}; "
              f"logs: {out_dir / 'cluster' / 'logs'}")
        return 1
    finally:
        watchdog.stop()
        cluster.stop()
    if state != "SUCCEEDED":
        print(f"run ended {state}: {run.error}\nlogs: {out_dir / 'cluster' / 'logs'}")
        return 1
    summary = summarize(out_dir / "metrics.jsonl")
    for key, label in (("accuracy", "validation accuracy"), ("any_format", "any-format accuracy")):
        first, last = summary[f"{key}_first"], summary[f"{key}_last"]
        if first is not None and last is not None:
            print(
                f"{label}: step 0 {first:.3f} -> step {summary['last_step']} {last:.3f} "
                f"({last - first:+.3f})"
            )
    print(f"finished in {time.monotonic() - started:.0f}s")
    print(f"metrics: {out_dir / 'metrics.jsonl'}")
    if trace:
        from marl.monitor import trace_summary

        events = trace_summary.load(out_dir / "trace")
        print(trace_summary.report(trace_summary.step_times(events), skip=1, events=events))
        trace_summary.write_chrome_trace(events, out_dir / "trace.json")
        print(f"trace: {out_dir / 'trace.json'} (open it in ui.perfetto.dev)")
    return 0


class _WatchedStub:
    """The learner stub, keeping the WatchRun call so that a watchdog can cancel it."""

    def __init__(self, stub: Any):
        self.stub = stub
        self.call: Any = None

    def WatchRun(self, request: Any) -> Any:  # noqa: N802 - the gRPC method's name
        self.call = self.stub.WatchRun(request)
        return self.call


class _Watchdog(threading.Thread):
    """Ends the demo's wait as soon as any service process exits: a dead workflow or
    inference service would otherwise leave the run waiting for its step timeout, and a
    dead learner would surface as a gRPC error."""

    def __init__(self, cluster: Any, watched: _WatchedStub):
        super().__init__(daemon=True)
        self.cluster, self.watched = cluster, watched
        self.died: list[str] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(0.5):
            dead = [d for p in self.cluster.dead() if (d := p.exit_description())]
            if dead:
                self.died = dead
                if self.watched.call is not None:
                    self.watched.call.cancel()
                return

    def stop(self) -> None:
        self._halt.set()


def summarize(metrics_path: Path) -> dict[str, Any]:
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    vals = [r for r in rows if "val/accuracy" in r]
    return {
        "accuracy_first": vals[0]["val/accuracy"],
        "accuracy_last": vals[-1]["val/accuracy"],
        "any_format_first": vals[0].get("val/any_format_correct"),
        "any_format_last": vals[-1].get("val/any_format_correct"),
        "last_step": rows[-1]["step"],
        "rows": rows,
    }


MAX_RESTARTS = 5
"""`marl up` restarts a service that dies, up to this many times in 10 minutes."""
MAX_LEARNER_NODES = 8
"""`marl up --learner-nodes`: nodes of one learner on this machine (a try of multi-node)."""


def run_up(
    workdir: Path,
    model: str | None,
    engine: str,
    cores: int | None = None,
    overlapped: bool = False,
    trace_dir: Path | None = None,
    max_concurrent_runs: int | None = None,
    learners: int = 1,
    learner_nodes: int = 1,
) -> int:
    from marl.local.launcher import DEFAULT_CORES, Cluster, service_threads
    from marl.spec.errors import UserError

    cores = DEFAULT_CORES if cores is None else cores
    if cores < 1:
        raise UserError(f"--cores: must be at least 1, got {cores}")
    if learners < 1:
        raise UserError(f"--learners: must be at least 1, got {learners}")
    if not 1 <= learner_nodes <= MAX_LEARNER_NODES:
        raise UserError(
            f"--learner-nodes: must be 1 to {MAX_LEARNER_NODES}, got {learner_nodes}"
        )
    if max_concurrent_runs is not None:
        try:
            LearnerConfig(max_concurrent_runs=max_concurrent_runs)
        except ValidationError as err:
            raise UserError(f"--max-concurrent-runs: {err.errors()[0]['msg']}") from None

    workdir = workdir.resolve()
    try:
        model_path = model_names.resolve(model) if model else str(demo_model())
    except ValueError as err:
        raise UserError(str(err).replace("field `model.path`", "--model")) from None
    engine = resolve_engine(engine)
    threads = service_threads(cores, overlapped)
    cluster = Cluster(workdir, model_path, engine=engine, redis_aof=True, threads=threads,
                      trace_dir=None if trace_dir is None else trace_dir.resolve(),
                      max_concurrent_runs=max_concurrent_runs, learner_replicas=learners,
                      learner_nodes=learner_nodes)
    cluster.start()
    cluster.write_endpoints(workdir / "endpoints.json")
    print(
        f"marl up: services running (torch threads: inference {threads['inference']}, "
        f"learner {threads['learner']}); endpoints in {workdir / 'endpoints.json'}; "
        "Ctrl-C stops them"
    )
    learner = cluster.endpoints()["learner"]
    print(f"learner at {learner}: marl submit/runs/status/watch find it from this folder "
          "(./marl-up/endpoints.json); elsewhere, first:")
    print(f"export MARL_LEARNER={learner}", flush=True)
    stopping = False

    def _stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    restarts: dict[str, list[float]] = {}
    try:
        while not stopping:
            if cluster.restart_redis():
                print("marl up: redis died; restarted it from its append-only file", flush=True)
            for p in cluster.dead():
                print(f"marl up: {p.exit_description()}", flush=True)
                recent = [t for t in restarts.get(p.log_path.name, []) if time.time() - t < 600]
                if len(recent) >= MAX_RESTARTS:
                    print(f"marl up: {p.kind} died {MAX_RESTARTS + 1} times in 10 minutes; "
                          "stopping (see its log)", flush=True)
                    return 1
                restarts[p.log_path.name] = [*recent, time.time()]
                try:
                    new = cluster.restart(p)
                except RuntimeError as err:  # died again while starting: the next turn retries
                    print(f"marl up: restarting the {p.kind} service failed: {err}", flush=True)
                    continue
                print(f"marl up: restarted the {p.kind} service at {new.address} "
                      f"(pid {new.proc.pid})", flush=True)
                cluster.write_endpoints(workdir / "endpoints.json")
            time.sleep(0.5)
    finally:
        cluster.stop()
        print("marl up: stopped")
    return 0
