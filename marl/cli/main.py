"""The `marl` command. Parses first; torch, transformers and vLLM load only where used.

Exit codes: 0 success, 1 a run or service failed, 2 a user error (the field or
input is named, no traceback).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import grpc

from marl.cli import learner_address
from marl.clients.runs import LearnerUnavailable, RunNotFound, RunRefused, RunsClient
from marl.spec.errors import UserError
from marl.spec.run import ENGINE_NAMES, SpecError
from marl.spec.services import InferenceConfig

ERROR_PREFIX = "marl: error: "
"""Every error the CLI prints starts so, argparse's own included."""


class _Parser(argparse.ArgumentParser):
    """argparse with one error prefix: a subcommand's usage, then `marl: error: ...`."""

    def error(self, message: str) -> Any:  # argparse's signature says NoReturn
        self.print_usage(sys.stderr)
        self.exit(2, f"{ERROR_PREFIX}{message}\n")


# ---------------------------------------------------------------- serve


def cmd_serve(args: argparse.Namespace) -> int:
    """Typed settings (`marl.spec.services`): defaults < --config < MARL_<SERVICE>_* < flags."""
    from marl.spec.services import MODELS, flag_values, load_service_config

    try:
        cfg = load_service_config(args.service, args.config, flag_values(args, args.service))
    except ValueError as err:
        raise UserError(str(err)) from None
    if "redis" in MODELS[args.service].model_fields and not cfg.redis:
        raise UserError(f"marl serve {args.service}: --redis URL is required")
    if cfg.trace_dir is not None:
        from marl.runtime import tracing

        tracing.configure(args.service, cfg.trace_dir)
    if args.service == "inference":
        from services.inference import server as inference

        if not cfg.model:
            raise UserError("marl serve inference: --model DIR is required")
        inference.run(cfg)
    elif args.service == "workflow":
        from services.workflow import server as workflow

        workflow.run(cfg)
    elif args.service == "learner":
        from services.learner import server as learner

        learner.run(cfg)
    else:
        from services.reward_sandbox import server as sandbox

        sandbox.run(cfg)
    return 0


# ---------------------------------------------------------------- runs API


def _learner(args: argparse.Namespace) -> str:
    """The learner's address (--learner, $MARL_LEARNER, ./marl-up/endpoints.json, default),
    kept on `args` so that an error can say where it came from."""
    found = learner_address.resolve(args.learner)
    args.learner_found = found
    return found.address


def _learner_stub(address: str) -> Any:
    from marl.protocol.v1 import learner_pb2_grpc
    from marl.runtime import auth

    return learner_pb2_grpc.LearnerStub(auth.channel(address))


def _spec_text(path: str, overrides: list[str]) -> str:
    import yaml

    from marl.spec.run import apply_overrides
    from marl.spec.safe_input import check_path, load_yaml, read_text, shorten

    p = check_path(path, "spec file", UserError)
    if not p.is_file():
        raise UserError(f"spec file {shorten(path)!r} does not exist")
    data = load_yaml(read_text(p, "spec file", UserError), shorten(path), UserError) or {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: a run spec must be a mapping of fields")
    return yaml.safe_dump(apply_overrides(data, overrides), sort_keys=False)


def cmd_submit(args: argparse.Namespace) -> int:
    """The spec is checked here first, so that a misspelt field is named whether or not a
    learner answers; the learner checks it again with what only it knows (paths, names)."""
    from marl.spec.run import load_spec_text

    text = _spec_text(args.spec, args.overrides)
    load_spec_text(text)
    with RunsClient(_learner(args)) as runs:
        print(runs.submit(text))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    with RunsClient(_learner(args)) as runs:
        run = runs.get(args.run)
    if args.json:
        print(json.dumps(run.to_dict(), indent=2))
    else:
        print(f"{run.run_id}  {run.state}  step {run.step}/{run.total_steps}  {run.out_dir}")
        if run.error:
            print(f"error: {run.error}")
        if run.steps_done:
            print(
                f"failed steps: {run.failed_steps} of {run.steps_done}  failed episodes: "
                f"{run.failed_episodes} of {run.episodes}"
            )
        for alarm in run.alarms:
            print(f"alarm: {alarm}")
        if run.dead_lettered:
            print(
                f"dead-lettered tasks: {run.dead_lettered} (failed max_deliveries times, left "
                "out of their steps; see the stream marl:tasks:dead and the workers' logs)"
            )
    return 0


def cmd_runs(args: argparse.Namespace) -> int:
    if args.page_size < 0:
        raise UserError(f"--page-size: must be 0 (the learner's default) or more, "
                        f"got {args.page_size}")
    with RunsClient(_learner(args)) as runs:
        for page in runs.pages(args.page_size):  # printed as each page comes
            for run in page:
                print(f"{run.run_id}  {run.state:<9}  step {run.step}/{run.total_steps}  "
                      f"{run.owner}  {run.out_dir}")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    with RunsClient(_learner(args)) as runs:
        run = runs.cancel(args.run)
    print(f"{run.run_id}  {run.state}")
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    from marl.monitor.watch import watch_dir, watch_run

    if Path(args.run).is_dir():
        try:
            return watch_dir(args.run, follow=not args.once)
        except ValueError as err:
            raise UserError(str(err)) from None
    address = _learner(args)
    with RunsClient(address, timeout=30) as runs:
        runs.get(args.run)  # no learner or no such run: one line and exit 2, before any table
    state = watch_run(_learner_stub(address), args.run)
    return 0 if state == "SUCCEEDED" else 1


def cmd_report(args: argparse.Namespace) -> int:
    from marl.monitor.report import write_report

    try:
        page = write_report(args.run_dir, args.out)
    except ValueError as err:
        raise UserError(str(err)) from None
    print(page)
    return 0


# ---------------------------------------------------------------- demo / up


def cmd_demo(args: argparse.Namespace) -> int:
    from marl.local.demo import run_demo

    return run_demo(args.out, args.steps, args.overrides, args.trace)


def cmd_model(args: argparse.Namespace) -> int:
    from marl.models.gguf_import import ModelImportError, import_gguf

    try:
        print(import_gguf(args.file, args.out, force=args.force))
    except ModelImportError as err:
        raise UserError(str(err)) from None
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from marl.local.demo import run_up

    trace_dir = None if args.trace is None else Path(args.trace)
    return run_up(Path(args.dir), args.model, args.engine, args.cores, args.overlapped, trace_dir,
                  max_concurrent_runs=args.max_concurrent_runs, learners=args.learners,
                  learner_nodes=args.learner_nodes)


def cmd_trace(args: argparse.Namespace) -> int:
    from marl.monitor import trace_summary

    trace_dir = Path(args.dir)
    if not trace_dir.is_dir() or not any(trace_dir.glob("*.jsonl")):
        raise UserError(f"{trace_dir}: no trace files (*.jsonl) there; start the services "
                        "with --trace (marl up, marl demo) or --trace-dir (marl serve)")
    events = trace_summary.load(trace_dir)
    steps = trace_summary.step_times(events)
    print(trace_summary.report(steps, skip=args.skip, events=events) if steps
          else "no training step traced")
    out = Path(args.out) if args.out else trace_dir / "trace.json"
    trace_summary.write_chrome_trace(events, out)
    print(f"{len(events)} events: {out} (open it in ui.perfetto.dev)")
    return 0


def cmd_sandbox_run(args: argparse.Namespace) -> int:
    from marl.clients.http_endpoints import HttpUserError, sandbox_run

    try:
        return sandbox_run(args.file, args.stdin, args.sandbox, args.timeout)
    except HttpUserError as err:
        raise UserError(str(err)) from None


def cmd_sandbox_doctor(args: argparse.Namespace) -> int:
    from services.reward_sandbox import doctor

    try:
        return doctor.show(args.config, args.json)
    except ValueError as err:
        raise UserError(str(err)) from None


def cmd_generate(args: argparse.Namespace) -> int:
    from marl.clients.http_endpoints import HttpUserError, generate

    try:
        return generate(args.model, args.prompt, args.inference, args.chat, args.max_tokens,
                        args.temperature, args.seed)
    except HttpUserError as err:
        raise UserError(str(err)) from None


def cmd_data(args: argparse.Namespace) -> int:
    from marl.data import inspection

    return inspection.run([args.spec, *args.overrides])


def cmd_episode(args: argparse.Namespace) -> int:
    from marl.cli.episode import main as episode_main
    from marl.spec.run import load_spec_text

    spec = load_spec_text(_spec_text(args.spec, args.overrides))
    return episode_main(spec, args.problem, args.checkpoint, args.endpoints, args.split,
                        args.sample, args.json)


def cmd_cluster(args: argparse.Namespace) -> int:
    from marl.cli import cluster

    try:
        return cluster.run(args)
    except cluster.ClusterError as err:
        raise UserError(str(err)) from None


# ---------------------------------------------------------------- parser


def add_serve_parser(sub: Any) -> None:
    """`marl serve SERVICE`: `--config FILE` and one flag per field of the service's model."""
    from marl.spec.services import MODELS, SERVICES, add_flags

    p = sub.add_parser("serve", help="run one service")
    services = p.add_subparsers(dest="service", required=True, metavar="SERVICE",
                                help="inference, workflow, learner or sandbox")
    for service in SERVICES:
        doc = (MODELS[service].__doc__ or "").strip()
        # no abbreviations: `--model` must not pass for the learner's `--model-roots`
        s = services.add_parser(service, help=doc.partition(": ")[2] or doc,
                                allow_abbrev=False)
        s.add_argument(
            "--config", default=None, help="YAML of the service's settings (marl.spec.services)"
        )
        add_flags(s, service)
    p.set_defaults(fn=cmd_serve)


LEARNER_HELP = (
    "the learner's gRPC address HOST:PORT (default: $MARL_LEARNER, else the learner in "
    "./marl-up/endpoints.json that `marl up` wrote, else 127.0.0.1:50051)"
)
SPEC_HELP = "a run spec YAML (examples/; every field in the configuration reference)"
OVERRIDES_HELP = "RunSpec fields as key=value, e.g. policy=isolated train.steps=10"


def _add_local_parsers(sub: Any) -> None:
    """demo, up, trace: the whole system on this machine."""
    p = sub.add_parser("demo", help="a short real training run on the CPU, every service a process")
    p.add_argument("--out", default=None, help="run output directory (default runs/demo-<time>)")
    p.add_argument("--steps", type=int, default=None,
                   help="training steps (default: the demo's 40, or train.steps)")
    p.add_argument("--trace", action="store_true",
                   help="trace every service into OUT/trace; print where each step's time "
                   "went and write OUT/trace.json (marl trace)")
    p.add_argument("overrides", nargs="*", default=[],
                   help=f"{OVERRIDES_HELP}; data.train_path=FILE.jsonl trains and validates "
                   "on your own math problems")
    p.set_defaults(fn=cmd_demo)

    p = sub.add_parser("up", help="start every service locally until Ctrl-C")
    p.add_argument("--dir", default="marl-up", help="where endpoints.json, logs and runs go")
    p.add_argument("--model", default=None,
                   help="base model: a directory, or demo / smollm2 (default: the demo model)")
    p.add_argument("--engine", default=InferenceConfig.model_fields["engine"].default,
                   choices=ENGINE_NAMES,
                   help="inference engine (auto: vLLM when installed, else transformers)")
    p.add_argument("--cores", type=int, default=None,
                   help="CPU cores the services' torch threads share (default 2)")
    p.add_argument(
        "--overlapped",
        action="store_true",
        help="for runs with train.max_staleness >= 1: inference and learner get disjoint "
        "shares of --cores instead of all of them each (the learner's update takes them all "
        "once the rollouts queued ahead are in)",
    )
    p.add_argument("--max-concurrent-runs", type=int, default=None, metavar="N",
                   help="runs each learner trains at once (default: learner.max_concurrent_runs)")
    p.add_argument("--learners", type=int, default=1, metavar="N",
                   help="learner processes taking runs from one queue")
    p.add_argument("--learner-nodes", type=int, default=1, metavar="N",
                   help="each learner as one group of N torchrun nodes on this machine, "
                   "joined over TCP (gloo): multi-node training without a cluster")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="every service appends its trace spans to DIR (read with marl trace DIR)")
    p.set_defaults(fn=cmd_up)

    p = sub.add_parser("trace", help="where each traced step's time went; merge into trace.json")
    p.add_argument("dir", help="the trace directory (marl up --trace DIR, OUT/trace of a demo)")
    p.add_argument("--out", default=None, help="merged Chrome trace file (default DIR/trace.json)")
    p.add_argument("--skip", type=int, default=1,
                   help="steps left out of the medians at the start of each run (warm-up)")
    p.set_defaults(fn=cmd_trace)


def _add_runs_parsers(sub: Any) -> None:
    """submit, status, watch, cancel, runs, report, episode: runs on a learner."""
    p = sub.add_parser("submit", help="submit a run spec to the learner; prints the run id")
    p.add_argument("spec", help=SPEC_HELP)
    p.add_argument("overrides", nargs="*", default=[], help=OVERRIDES_HELP)
    p.add_argument("--learner", default=None, metavar="ADDR", help=LEARNER_HELP)
    p.set_defaults(fn=cmd_submit)

    p = sub.add_parser("status", help="a run's state, failed steps and alarms")
    p.add_argument("run", help="the run id (marl submit printed it; marl runs lists them)")
    p.add_argument("--learner", default=None, metavar="ADDR", help=LEARNER_HELP)
    p.add_argument("--json", action="store_true", help="print the run as one JSON object")
    p.set_defaults(fn=cmd_status)

    p = sub.add_parser("watch", help="follow a run live (a run id, or a run directory)")
    p.add_argument("run", help="a run id on the learner, or a run directory (its metrics.jsonl)")
    p.add_argument("--learner", default=None, metavar="ADDR", help=LEARNER_HELP)
    p.add_argument("--once", action="store_true", help="a run directory: draw once, exit")
    p.set_defaults(fn=cmd_watch)

    p = sub.add_parser("cancel", help="cancel a run")
    p.add_argument("run", help="the run id")
    p.add_argument("--learner", default=None, metavar="ADDR", help=LEARNER_HELP)
    p.set_defaults(fn=cmd_cancel)

    p = sub.add_parser("runs", help="list the runs you may see (yours; all for an admin)")
    p.add_argument("--learner", default=None, metavar="ADDR", help=LEARNER_HELP)
    p.add_argument("--page-size", type=int, default=0,
                   help="runs per ListRuns call (0: the learner's default, 100)")
    p.set_defaults(fn=cmd_runs)

    p = sub.add_parser("report", help="report.html with per-role drift plots of a run directory")
    p.add_argument("run_dir", help="a run directory (its metrics.jsonl and run.yaml)")
    p.add_argument("--out", default=None, help="where report.html and its PNGs go (default RUN_DIR)")
    p.set_defaults(fn=cmd_report)

    p = sub.add_parser("episode", help="one episode on a running cluster, transcript printed")
    p.add_argument("spec", help=SPEC_HELP)
    p.add_argument("overrides", nargs="*", default=[], help=OVERRIDES_HELP)
    p.add_argument("--problem", type=int, required=True, help="index into the data split")
    p.add_argument("--split", default="train", choices=["train", "val"],
                   help="which split --problem indexes")
    p.add_argument("--sample", type=int, default=0, help="sample index (changes the seeds)")
    p.add_argument("--checkpoint", default=None,
                   help="a checkpoints/step_N dir or a run dir (default: the base model)")
    p.add_argument("--endpoints", default="marl-up", help="`marl up --dir` or its endpoints.json")
    p.add_argument("--json", action="store_true", help="print the rollout as JSON")
    p.set_defaults(fn=cmd_episode)


def _add_tool_parsers(sub: Any) -> None:
    """sandbox, generate, model, data: tools with subcommands of their own."""
    p = sub.add_parser("sandbox", help="the code sandbox: its isolation tier; run a program in it")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION",
                               help="doctor or run")
    s = actions.add_parser("doctor", help="this machine's isolation tier: what is and is not "
                           "protected")
    s.add_argument("--config", default=None, help="the sandbox service's config YAML")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(fn=cmd_sandbox_doctor)
    s = actions.add_parser("run", help="run a Python program in a running sandbox")
    s.add_argument("file", help="the Python program to run")
    s.add_argument("--stdin", default=None, help="a file given to the program as stdin")
    s.add_argument("--sandbox", default=None,
                   help="the sandbox's HTTP URL (default: $MARL_SANDBOX_HTTP, else "
                   "./marl-up/endpoints.json's sandbox_http)")
    s.add_argument("--timeout", type=float, default=10.0, help="seconds the program gets")
    s.set_defaults(fn=cmd_sandbox_run)

    p = sub.add_parser("generate", help="one completion from a running inference replica")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--model", required=True, help="the base model's name or run/policy@version")
    p.add_argument("--inference", default=None,
                   help="the replica's HTTP URL (default: $MARL_INFERENCE_HTTP, else "
                   "./marl-up/endpoints.json's inference_http)")
    p.add_argument("--chat", action="store_true", help="send the prompt as a chat message")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("model", help="model tools: import a GGUF checkpoint as safetensors")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION", help="import")
    s = actions.add_parser("import", help="a GGUF checkpoint as a safetensors model directory")
    s.add_argument("file", help="a GGUF checkpoint, e.g. SmolLM2-135M-Instruct.Q4_1.gguf")
    s.add_argument("out", help="the model directory to write (model.path in a run spec)")
    s.add_argument("--force", action="store_true", help="write into a non-empty OUT")
    s.set_defaults(fn=cmd_model)

    p = sub.add_parser("data", help="dataset tools: what a spec's data holds")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION", help="inspect")
    s = actions.add_parser("inspect", help="counts, samples and answer formats of a spec's "
                           "train and val data")
    s.add_argument("spec", help=SPEC_HELP)
    s.add_argument("overrides", nargs="*", default=[], help=OVERRIDES_HELP)
    s.set_defaults(fn=cmd_data)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="marl", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--version", action="version", version=f"marl {_version()}",
                        help="print marl's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="`marl COMMAND --help` for its options")
    _add_local_parsers(sub)
    add_serve_parser(sub)
    _add_runs_parsers(sub)
    _add_tool_parsers(sub)

    from marl.cli.cluster import add_parser as add_cluster_parser

    add_cluster_parser(sub)
    sub.choices["cluster"].set_defaults(fn=cmd_cluster)

    from marl.cli.experiments import add_parsers as add_experiment_parsers

    add_experiment_parsers(sub)  # matrix, eval, attribute
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("marl")
    except PackageNotFoundError:  # run from a source tree that was never installed
        import marl

        return marl.__version__


def _error(message: str) -> None:
    print(f"{ERROR_PREFIX}{message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # `marl demo model.path=DIR --steps 2 lora.rank=8`: key=value overrides after an
        # option are overrides too (argparse takes one run of positionals only)
        if hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
            args.overrides = [*(args.overrides or []), *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.fn(args))
    except (UserError, SpecError, RunRefused, RunNotFound) as err:
        _error(str(err.args[0] if err.args else err))
        return 2
    except LearnerUnavailable as err:
        found = getattr(args, "learner_found", None)
        where = f"; {found.explain()}" if found is not None else ""
        _error(f"{err.args[0] if err.args else err}{where}")
        return 2
    except grpc.RpcError as err:  # a service that went away mid-call: no traceback
        code = err.code() if hasattr(err, "code") else None
        details = err.details() if hasattr(err, "details") else str(err)
        name = code.name if code is not None else "error"
        _error(f"the service answered {name}: {details} (did it die? "
               "`marl up` names a dead service and its log)")
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
