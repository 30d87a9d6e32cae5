"""Every service setting's default is written once: in its model, `marl/spec/services.py`.

A default written again (a server's `run(concurrency=512)`, an internal class's
`max_queued_tasks=4096`, a hand-written `--flag` with `default=`) drifts from the
model the day one of them changes, and then `marl serve`, the Helm chart and a test that
builds the server directly each run with a different value. So the services take their
model (`run(cfg)`) and hand its values on, and `marl serve`'s flags are made from it.

The check walks `marl/` and `services/` with `ast` and names, file:line, every default
given to a name that is a field of a service model:
- a parameter's default (`def f(concurrency=512)`, lambdas too);
- a class-body default (a dataclass's or NamedTuple's `tmp_bytes: int = 64 << 20`);
- `add_argument("--field-name", default=...)`.
A field shared by every model (host, port, http_port, trace_dir, redis) counts
everywhere; a service's own field counts in `marl/` and in that service's package (a
learner's torch `device` is not the inference replica's setting). In `services/` a
`None` default counts too: there it is a default of the code's own. In `marl/` (the CLI,
the launcher, the shared runtime) and for flags, `None` says "not given: the config
decides", and is left alone.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from marl.spec.services import MODELS, SERVICES

ROOT = Path(__file__).resolve().parents[2]

PACKAGE_OF = {
    "inference": "services/inference",
    "workflow": "services/workflow",
    "learner": "services/learner",
    "sandbox": "services/reward_sandbox",
}

SKIPPED = {
    "marl/spec/services.py": "the service models themselves: the one place a default is written",
    "marl/spec/run.py": "RunSpec: a run's settings (model.dtype, engine...), a model of their own",
}

ALLOWED = {
    ("marl/runtime/serving.py", "serve_until_stopped", "drain_s"):
        "the stop grace of every service (0: none); the workflow passes its drain_s + 1",
    ("services/inference/sampling.py", "row_uniforms", "device"):
        "a tensor's torch device, not the replica's `device` setting",
    ("marl/local/launcher.py", "Cluster", "engine"):
        "a local cluster for tests and benches runs the transformers engine unless told: "
        "the replicas' own default (auto) would pick vLLM wherever it is installed",
}
"""(file, where, name) -> why that default is not a service setting's."""


@dataclass(frozen=True)
class Default:
    path: str
    line: int
    where: str
    name: str
    value: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.where}: {self.name}={self.value}"


def fields_in_scope(path: str) -> set[str]:
    """The model fields a default in `path` must not restate."""
    owners: dict[str, set[str]] = {}
    for service in SERVICES:
        for name in MODELS[service].model_fields:
            owners.setdefault(name, set()).add(service)
    if path.startswith("marl/"):
        return set(owners)
    mine = {s for s, package in PACKAGE_OF.items() if path.startswith(package + "/")}
    return {name for name, services in owners.items() if services & mine or services >= set(SERVICES)}


class _Finder(ast.NodeVisitor):
    def __init__(self, path: str):
        self.path = path
        self.fields = fields_in_scope(path)
        self.none_counts = path.startswith("services/")
        self.scope: list[str] = []
        self.found: list[Default] = []

    def _add(self, node: ast.AST, name: str, value: ast.expr | None, none_counts: bool) -> None:
        if value is None or name not in self.fields:
            return
        if isinstance(value, ast.Constant) and value.value is None and not none_counts:
            return
        if "model_fields" in ast.unparse(value):  # the model's own default, read from it
            return
        where = ".".join(self.scope) or "<module>"
        self.found.append(Default(self.path, value.lineno, where, name, ast.unparse(value)))

    def _arguments(self, args: ast.arguments) -> None:
        positional = [*args.posonlyargs, *args.args]
        for arg, value in zip(positional[len(positional) - len(args.defaults):], args.defaults,
                              strict=True):
            self._add(arg, arg.arg, value, self.none_counts)
        for arg, kw_value in zip(args.kwonlyargs, args.kw_defaults, strict=True):
            self._add(arg, arg.arg, kw_value, self.none_counts)

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scope.append(node.name)
        self._arguments(node.args)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self._arguments(node.args)
        self.generic_visit(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.scope.append(node.name)
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                self._add(stmt, stmt.target.id, stmt.value, self.none_counts)
        self.generic_visit(node)
        self.scope.pop()

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            default = next((k.value for k in node.keywords if k.arg == "default"), None)
            for arg in node.args:
                if isinstance(arg, ast.Constant) and str(arg.value).startswith("--"):
                    self._add(node, str(arg.value)[2:].replace("-", "_"), default, False)
        self.generic_visit(node)


def defaults_of_settings(root: Path = ROOT) -> list[Default]:
    found: list[Default] = []
    for package in ("marl", "services"):
        for file in sorted((root / package).rglob("*.py")):
            path = file.relative_to(root).as_posix()
            if path in SKIPPED or path.startswith("marl/protocol/v1/"):
                continue
            finder = _Finder(path)
            finder.visit(ast.parse(file.read_text(encoding="utf-8"), path))
            found += finder.found
    return found


def test_no_service_setting_default_is_written_twice() -> None:
    found = defaults_of_settings()
    known = ALLOWED.keys()
    twice = [d for d in found if (d.path, d.where, d.name) not in known]
    assert not twice, (
        "service settings defaulted outside marl/spec/services.py (take the service's config "
        "object, or make the parameter required):\n" + "\n".join(map(str, twice))
    )
    stale = known - {(d.path, d.where, d.name) for d in found}
    assert not stale, f"allowances that match no default any more (remove them): {sorted(stale)}"


def test_the_check_sees_a_default_written_twice(tmp_path: Path) -> None:
    """The walk itself: a restated default is named with its file and line; the model and
    a None that says "not given" in marl/ are not."""
    (tmp_path / "services" / "workflow").mkdir(parents=True)
    (tmp_path / "marl" / "spec").mkdir(parents=True)
    (tmp_path / "services" / "workflow" / "loop.py").write_text(
        "def work(runner, concurrency=512, *, sandbox=None, other=1):\n    pass\n"
        "class Plan:\n    max_deliveries: int = 5\n"
    )
    (tmp_path / "services" / "learner").mkdir()
    (tmp_path / "services" / "learner" / "policy.py").write_text(
        "def load(device='cpu', runs_dir='runs'):\n    pass\n"  # device: not a learner field
    )
    (tmp_path / "marl" / "cli.py").write_text(
        "def serve(p, port=None):\n"
        "    p.add_argument('--concurrency', type=int, default=8)\n"
        "    p.add_argument('--redis', default=None)\n"
        "    p.add_argument('--engine', default=InferenceConfig.model_fields['engine'].default)\n"
    )
    (tmp_path / "marl" / "spec" / "services.py").write_text("def f(concurrency=512): pass\n")
    found = sorted(map(str, defaults_of_settings(tmp_path)))
    assert found == [
        "marl/cli.py:2: serve: concurrency=8",
        "services/learner/policy.py:1: load: runs_dir='runs'",
        "services/workflow/loop.py:1: work: concurrency=512",
        "services/workflow/loop.py:1: work: sandbox=None",
        "services/workflow/loop.py:4: Plan: max_deliveries=5",
    ]


def test_marl_serve_flags_are_the_models_fields() -> None:
    """`marl serve X --help` lists one flag per field, with the model's default."""
    import argparse

    from marl.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = sub.choices["serve"]
    services = next(a for a in serve._actions if isinstance(a, argparse._SubParsersAction))
    for service in SERVICES:
        flags = {
            a.dest: a for a in services.choices[service]._actions if a.option_strings
        }
        assert set(flags) - {"help", "config"} == set(MODELS[service].model_fields), service
        for name, info in MODELS[service].model_fields.items():
            assert flags[name].default is None  # unset: the file and the environment decide
            assert f"--{name.replace('_', '-')}" in flags[name].option_strings
            if info.default_factory is None and info.default not in (None, ""):
                assert f"(default: {info.default})" in str(flags[name].help), name
