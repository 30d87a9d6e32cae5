"""The `marl matrix`, `marl eval` and `marl attribute` subcommands (see marl/experiments/matrix.py and
marl/experiments/evaluate.py); registered on the `marl` parser by `add_parsers`."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from marl.spec.run import RunSpec, SpecError, apply_overrides, parse_spec


def cmd_matrix(args: argparse.Namespace) -> int:
    from marl.experiments import matrix
    from marl.experiments.matrix_report import write_report

    action, *rest = args.target
    if action in ("report", "status"):
        if len(rest) != 1:
            raise SpecError(f"usage: marl matrix {action} DIR")
        root = Path(rest[0])
        if action == "report":
            paths = write_report(root, Path(args.out) if args.out else None, args.chi2)
            print(paths["markdown"].read_text())
            _print_report(paths)
            return 0
        print("\n".join(matrix.status_lines(root, matrix.saved_matrix(root))))
        return 0
    if rest:
        raise SpecError("usage: marl matrix MATRIX.yaml [--out DIR] [--dry-run] | report DIR | "
                        "status DIR")
    m = matrix.load_matrix(action)
    if args.dry_run:
        from marl.experiments.estimate import plan_lines

        print("\n".join(plan_lines(m)))
        return 0
    root = Path(args.out or f"matrix-{m.name}")
    rc = matrix.run_matrix(
        m, root, learner=args.learner, redis_url=args.redis, parallel=args.parallel
    )
    _print_report(write_report(root, chi2=args.chi2))
    return rc


def _print_report(paths: dict[str, Path]) -> None:
    index = paths["index.html"]
    names = sorted(p.name for k, p in paths.items() if k == p.name and k != "index.html")
    print(f"report: {index} ({', '.join(names)} in {index.parent})")


def _spec(path: str, overrides: list[str]) -> RunSpec:
    p = Path(path)
    if p.is_dir():
        p = p / "run.yaml"
    if not p.is_file():
        raise SpecError(f"spec {path!r}: no such file (a spec YAML or a run directory)")
    data = yaml.safe_load(p.read_text()) or {}
    if not isinstance(data, dict):
        raise SpecError(f"{p}: a run spec must be a mapping of fields")
    return parse_spec(apply_overrides(data, overrides))


class EvalFailed(Exception):
    """A service the evaluation needs failed or refused (exit 1)."""


def _with_cluster(spec: RunSpec, redis_url: str | None, fn: Any) -> Any:
    import grpc
    from redis.exceptions import ConnectionError as RedisUnreachable

    try:
        return _on_cluster(spec, redis_url, fn)
    except RedisUnreachable as err:
        raise SpecError(
            f"--redis {redis_url}: cannot connect ({err}); pass a running cluster's "
            "Redis URL, or leave --redis out to start one"
        ) from None
    except grpc.RpcError as err:
        raise EvalFailed(f"an inference replica refused the evaluation: {err}") from None
    except RuntimeError as err:
        raise EvalFailed(str(err)) from None


def _on_cluster(spec: RunSpec, redis: str | None, fn: Any) -> Any:
    if redis:
        return fn(redis)
    from marl.experiments.evaluate import EvalCluster

    with (
        tempfile.TemporaryDirectory(prefix="marl-eval-") as tmp,
        EvalCluster(Path(tmp), spec) as url,
    ):
        return fn(url)


def cmd_eval(args: argparse.Namespace) -> int:
    try:
        return _cmd_eval(args)
    except EvalFailed as err:
        print(f"marl: error: {err}", file=sys.stderr)
        return 1


def _cmd_eval(args: argparse.Namespace) -> int:
    from marl.experiments.evaluate import evaluate_sync, parse_routing
    from marl.workflows.routing import policy_of_role

    spec = _spec(args.spec, args.overrides)
    routing = parse_routing(args.adapters, list(policy_of_role(spec)))
    for role, src in routing.items():
        print(f"{role:<16} <- {src.label}", file=sys.stderr)
    metrics = _with_cluster(spec, args.redis, lambda url: evaluate_sync(spec, routing, url))
    result = {"routing": {r: s.label for r, s in routing.items()}, **metrics}
    if metrics["val/episode_errors"]:
        print(
            f"warning: {metrics['val/episode_errors']} episodes failed (scored 0), e.g. "
            f"{metrics['val/first_episode_error']}",
            file=sys.stderr,
        )
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"validation accuracy {metrics['val/accuracy']:.3f} "
            f"on {metrics['val/problems']} problems "
            f"({metrics['val/episode_errors']} episode errors)"
        )
    return 0


def cmd_attribute(args: argparse.Namespace) -> int:
    try:
        return _cmd_attribute(args)
    except EvalFailed as err:
        print(f"marl: error: {err}", file=sys.stderr)
        return 1


def _cmd_attribute(args: argparse.Namespace) -> int:
    from marl.experiments.evaluate import attribute, format_attribution, run_spec

    run_dir = Path(args.run_dir)
    spec = run_spec(run_dir)
    result = _with_cluster(
        spec,
        args.redis,
        lambda url: attribute(run_dir, args.checkpoint, args.baseline, url),
    )
    print(json.dumps(result) if args.json else format_attribution(result))
    return 0


def add_parsers(sub: Any) -> None:
    p = sub.add_parser(
        "matrix",
        help="the paper's matrix: MATRIX.yaml runs every cell, its controls and Table 3's "
        "evaluations (resumable); `report DIR` writes Tables 1-6, Figs. 2-6 and index.html "
        "to DIR/report; `status DIR` shows each cell",
    )
    p.add_argument("target", nargs="+", metavar="MATRIX.yaml | report DIR | status DIR",
                   help="a matrix YAML to run (examples/matrix_demo.yaml), or `report DIR` / "
                   "`status DIR` of a matrix directory")
    p.add_argument(
        "--out",
        default=None,
        help="matrix directory (default matrix-<name>); report: where the report "
        "goes (default DIR/report)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="list every cell (and Table 3 evaluation) with its key settings and an estimate "
        "of its GPU hours, and run nothing",
    )
    p.add_argument(
        "--chi2",
        default="auto",
        choices=["auto", "chi2_token", "update_chi2"],
        help="the χ² series of Table 2 and Figs. 5-6: the paper's token-level χ², how far "
        "each policy moved during the step, or auto (default): the token-level χ² unless "
        "it stayed within the cell's alarms.chi2_noise_floor, then the other",
    )
    p.add_argument(
        "--learner",
        default=None,
        help="submit to this cluster's learner instead of running embedded",
    )
    p.add_argument(
        "--redis",
        default=None,
        help="with --learner: the cluster's Redis URL (the base-model control)",
    )
    p.add_argument(
        "--parallel",
        type=int,
        default=1,
        metavar="N",
        help="cells trained at once (default 1): embedded, the learner trains N runs at "
        "once; with --learner, give its learner.max_concurrent_runs >= N (or N learner "
        "replicas), else the cells beyond it wait in its queue",
    )
    p.set_defaults(fn=cmd_matrix)

    p = sub.add_parser(
        "eval", help="validation accuracy with each role served by a saved adapter or the base"
    )
    p.add_argument("spec", help="run spec YAML or a run directory (its run.yaml)")
    p.add_argument("overrides", nargs="*", default=[], help="key=value overrides")
    p.add_argument(
        "--adapters",
        default="",
        help="role=RUN_DIR@best[:POLICY] or role=base, comma separated; `*=` for "
        "every other role; roles not named get the base model",
    )
    p.add_argument(
        "--redis", default=None, help="a running cluster's Redis URL (default: start one embedded)"
    )
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(fn=cmd_eval)

    p = sub.add_parser(
        "attribute", help="each role's contribution: replace its adapter by the base model"
    )
    p.add_argument("run_dir", help="a finished run's directory")
    p.add_argument("--checkpoint", default="best", help="best, latest, step_N or N")
    p.add_argument(
        "--baseline",
        default="base",
        help="what replaces a role: base, or an earlier checkpoint (step_N)",
    )
    p.add_argument(
        "--redis", default=None, help="a running cluster's Redis URL (default: start one embedded)"
    )
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(fn=cmd_attribute)
