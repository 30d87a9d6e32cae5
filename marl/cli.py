"""The `marl` command. Parses first; torch, transformers and vLLM load only where used.

Exit codes: 0 success, 1 a run or service failed, 2 a user error (the field or
input is named, no traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from marl.config import SpecError

DEFAULT_LEARNER = "127.0.0.1:50051"


class UserError(Exception):
    """Something the user can fix; printed without a traceback, exit 2."""


def _cache_root() -> Path:
    return Path(os.environ.get("MARL_CACHE", Path.home() / ".cache" / "marl"))


# ---------------------------------------------------------------- serve


def cmd_serve(args: argparse.Namespace) -> int:
    cfg: dict[str, Any] = {}
    if args.config:
        import yaml

        path = Path(args.config)
        if not path.is_file():
            raise UserError(f"--config: {args.config!r} does not exist")
        cfg = yaml.safe_load(path.read_text()) or {}
        if not isinstance(cfg, dict):
            raise UserError(f"--config: {args.config!r} must be a mapping of settings")
    port = args.port if args.port is not None else int(cfg.get("port", 0))
    redis_url: str = args.redis or cfg.get("redis") or ""
    host = cfg.get("host", "127.0.0.1")
    if args.service in ("inference", "workflow", "learner") and not redis_url:
        raise UserError(f"marl serve {args.service}: --redis URL is required")
    if args.service == "inference":
        from services.inference import server as inference

        model = args.model or cfg.get("model")
        if not model:
            raise UserError("marl serve inference: --model DIR is required")
        inference.run(
            port,
            model,
            host=host,
            engine=args.engine or cfg.get("engine", "auto"),
            dtype=cfg.get("dtype", "float32"),
            redis_url=redis_url,
            retention=int(cfg.get("retention", 2)),
            max_lora_rank=args.max_lora_rank or int(cfg.get("max_lora_rank", 64)),
        )
    elif args.service == "workflow":
        from services.workflow import server as workflow

        workflow.run(
            port,
            redis_url,
            host=host,
            sandbox=args.sandbox or cfg.get("sandbox"),
            concurrency=int(cfg.get("concurrency", 512)),
        )
    elif args.service == "learner":
        from services.learner import server as learner

        learner.run(
            port, redis_url, host=host, runs_dir=args.runs_dir or cfg.get("runs_dir", "runs")
        )
    else:
        from services.reward_sandbox import server as sandbox

        sandbox.run(port, host=host, config_path=args.config)
    return 0


# ---------------------------------------------------------------- runs API


def _learner_stub(address: str) -> Any:
    import grpc

    from marl.v1 import learner_pb2_grpc

    return learner_pb2_grpc.LearnerStub(grpc.insecure_channel(address))


def _rpc(call: Any, *args: Any, **kw: Any) -> Any:
    import grpc

    try:
        return call(*args, timeout=kw.pop("timeout", 60), **kw)
    except grpc.RpcError as err:
        code = err.code()
        if code in (
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.FAILED_PRECONDITION,
        ):
            raise UserError(err.details()) from None
        if code == grpc.StatusCode.UNAVAILABLE:
            raise UserError(
                f"the learner is not reachable ({err.details()}); start it or pass --learner"
            ) from None
        raise


def _spec_text(path: str, overrides: list[str]) -> str:
    import yaml

    from marl.config import apply_overrides

    p = Path(path)
    if not p.is_file():
        raise UserError(f"spec file {path!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as err:
        raise UserError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: a run spec must be a mapping of fields")
    return yaml.safe_dump(apply_overrides(data, overrides), sort_keys=False)


def cmd_submit(args: argparse.Namespace) -> int:
    from marl.v1 import learner_pb2

    text = _spec_text(args.spec, args.overrides)
    resp = _rpc(_learner_stub(args.learner).SubmitRun, learner_pb2.SubmitRunRequest(spec_yaml=text))
    print(resp.run_id)
    return 0


def _run_dict(run: Any) -> dict[str, Any]:
    return {
        "run_id": run.run_id,
        "state": run.state,
        "step": run.step,
        "total_steps": run.total_steps,
        "out_dir": run.out_dir,
        "error": run.error,
        "last_metrics": json.loads(run.last_metrics_json) if run.last_metrics_json else None,
    }


def cmd_status(args: argparse.Namespace) -> int:
    from marl.v1 import learner_pb2

    run = _rpc(_learner_stub(args.learner).GetRun, learner_pb2.GetRunRequest(run_id=args.run))
    if args.json:
        print(json.dumps(_run_dict(run), indent=2))
    else:
        print(f"{run.run_id}  {run.state}  step {run.step}/{run.total_steps}  {run.out_dir}")
        if run.error:
            print(f"error: {run.error}")
    return 0


def cmd_runs(args: argparse.Namespace) -> int:
    from marl.v1 import learner_pb2

    resp = _rpc(_learner_stub(args.learner).ListRuns, learner_pb2.ListRunsRequest())
    for run in resp.runs:
        print(f"{run.run_id}  {run.state:<9}  step {run.step}/{run.total_steps}  {run.out_dir}")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    from marl.v1 import learner_pb2

    run = _rpc(_learner_stub(args.learner).CancelRun, learner_pb2.CancelRunRequest(run_id=args.run))
    print(f"{run.run_id}  {run.state}")
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    from marl.progress import follow_run

    state = follow_run(_learner_stub(args.learner), args.run, from_start=True)
    return 0 if state == "SUCCEEDED" else 1


# ---------------------------------------------------------------- demo / up


def cmd_demo(args: argparse.Namespace) -> int:
    from marl.demo import run_demo

    return run_demo(args.out, args.steps, args.overrides)


def cmd_up(args: argparse.Namespace) -> int:
    from marl.demo import run_up

    return run_up(Path(args.dir), args.model, args.engine)


def cmd_sandbox(args: argparse.Namespace) -> int:
    from services.reward_sandbox import doctor

    return doctor.main()


def cmd_data(args: argparse.Namespace) -> int:
    from marl.data import inspect

    return inspect.main([args.spec, *args.overrides])


# ---------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="marl", description=__doc__.splitlines()[0] if __doc__ else None
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="a short real training run on the CPU, every service a process")
    p.add_argument("--out", default=None, help="run output directory (default runs/demo-<time>)")
    p.add_argument("--steps", type=int, default=None, help="training steps")
    p.add_argument("overrides", nargs="*", help="RunSpec fields as key=value, e.g. policy=isolated")
    p.set_defaults(fn=cmd_demo)

    p = sub.add_parser("up", help="start every service locally until Ctrl-C")
    p.add_argument("--dir", default="marl-up", help="where endpoints.json, logs and runs go")
    p.add_argument("--model", default=None, help="base model dir (default: the demo model)")
    p.add_argument("--engine", default="auto", choices=["auto", "vllm", "transformers"])
    p.set_defaults(fn=cmd_up)

    p = sub.add_parser("serve", help="run one service")
    p.add_argument("service", choices=["inference", "workflow", "learner", "sandbox"])
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--redis", default=None, help="Redis URL, e.g. redis://127.0.0.1:6379/0")
    p.add_argument("--config", default=None, help="YAML file with the same settings")
    p.add_argument("--model", default=None, help="inference: base model directory")
    p.add_argument("--engine", default=None, choices=["auto", "vllm", "transformers"])
    p.add_argument(
        "--max-lora-rank", type=int, default=None, help="inference: largest adapter rank served"
    )
    p.add_argument("--sandbox", default=None, help="workflow: sandbox address for code rewards")
    p.add_argument("--runs-dir", default=None, help="learner: where run directories go")
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser("submit", help="submit a run spec to the learner; prints the run id")
    p.add_argument("spec")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    p.add_argument("--learner", default=DEFAULT_LEARNER)
    p.set_defaults(fn=cmd_submit)

    for name, fn, helptext in [
        ("status", cmd_status, "a run's state"),
        ("watch", cmd_watch, "follow a run's steps live"),
        ("cancel", cmd_cancel, "cancel a run"),
    ]:
        p = sub.add_parser(name, help=helptext)
        p.add_argument("run")
        p.add_argument("--learner", default=DEFAULT_LEARNER)
        if name == "status":
            p.add_argument("--json", action="store_true")
        p.set_defaults(fn=fn)

    p = sub.add_parser("runs", help="list runs")
    p.add_argument("--learner", default=DEFAULT_LEARNER)
    p.set_defaults(fn=cmd_runs)

    p = sub.add_parser("sandbox", help="sandbox tools")
    p.add_argument("action", choices=["doctor"])
    p.set_defaults(fn=cmd_sandbox)

    p = sub.add_parser("data", help="dataset tools")
    p.add_argument("action", choices=["inspect"])
    p.add_argument("spec")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(fn=cmd_data)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except (UserError, SpecError) as err:
        print(f"marl {args.command}: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
