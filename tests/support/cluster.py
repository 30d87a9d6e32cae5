"""The cluster fixtures: every service a process on loopback (marl.local.launcher), shaped
by keyword arguments, stopped (and the environment it was given restored) when the
fixture's scope ends.

A module that shares one cluster between its tests marks its shape and takes `cluster`:

    pytestmark = pytest.mark.cluster(model_fixture="tiny_model_dir", sandbox_replicas=0)

    def test_x(cluster: Cluster) -> None: ...

A test that needs a cluster of its own (or a module that needs two) calls `clusters(...)`
or `module_clusters(...)` with the same arguments."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from marl.local.launcher import Cluster
from tests.support.specs import demo_model_dir


class ClusterFactory:
    """Starts clusters on request and stops them all at `close`. `model`: the path or name
    the replicas serve (the shipped demo model's directory when not given);
    `model_fixture`: the name of a fixture that gives it instead ("tiny_model_dir");
    `env`: variables set in this process (and so in every service it starts, a
    replacement too) until `close`, or a function of a new directory that gives them;
    `traced`: every service writes its spans under the cluster's `trace/`; the rest are `Cluster` fields. The same arguments
    again give the cluster already started."""

    def __init__(self, request: pytest.FixtureRequest, tmp: pytest.TempPathFactory) -> None:
        self.request = request
        self.tmp = tmp
        self.env = pytest.MonkeyPatch()
        self.started: dict[str, Cluster] = {}

    def __call__(
        self,
        model: str | Path | None = None,
        model_fixture: str | None = None,
        env: dict[str, str] | Callable[[Path], dict[str, str]] | None = None,
        traced: bool = False,
        **fields: Any,
    ) -> Cluster:
        key = repr((model, model_fixture, env, traced, sorted(fields.items())))
        if key in self.started:
            return self.started[key]
        if callable(env):
            env = env(self.tmp.mktemp("env"))
        for name, value in (env or {}).items():
            self.env.setenv(name, value)
        fields.setdefault("engine", "transformers")
        workdir = fields.pop("workdir", None) or self.tmp.mktemp("cluster")
        if traced:
            fields["trace_dir"] = workdir / "trace"
        if model_fixture is not None:
            model = self.request.getfixturevalue(model_fixture)
        c = Cluster(workdir, str(model if model is not None else demo_model_dir()), **fields)
        c.start()
        self.started[key] = c
        return c

    def close(self) -> None:
        try:
            for c in self.started.values():
                c.stop()
        finally:
            self.started.clear()
            self.env.undo()


@pytest.fixture()
def clusters(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ClusterFactory]:
    """Clusters that live for one test."""
    factory = ClusterFactory(request, tmp_path_factory)
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture(scope="module")
def module_clusters(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ClusterFactory]:
    """Clusters that live for the module's tests."""
    factory = ClusterFactory(request, tmp_path_factory)
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest, module_clusters: ClusterFactory) -> Cluster:
    """The module's one cluster, shaped by its `pytest.mark.cluster(...)` arguments
    (`ClusterFactory`); a module without the mark gets the default shape."""
    mark = request.node.get_closest_marker("cluster")
    return module_clusters(**(mark.kwargs if mark else {}))


@pytest.fixture(scope="module")
def endpoints(cluster: Cluster) -> dict[str, Any]:
    """The module's cluster's addresses (`Cluster.endpoints`)."""
    return cluster.endpoints()


def learner_spans(cluster: Cluster, name: str, run: str | None = None) -> list[tuple[float, float]]:
    """(start, end) in µs of each span `name` the traced cluster's learner wrote so far (of
    run `run` alone, if given)."""
    from marl.monitor import trace_summary

    assert cluster.trace_dir is not None, "a cluster started with traced=True"
    events = trace_summary.load(cluster.trace_dir)
    learner = {e["pid"] for e in events if e.get("args", {}).get("name") == "learner"}
    return [
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e["pid"] in learner and e.get("ph") == "X" and e["name"] == name
        and (run is None or e.get("args", {}).get("run") == run)
    ]
