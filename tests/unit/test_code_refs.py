"""Which code a run spec may name (marl/spec/code_refs.py), and bounded spec input.

An installed package is made for real: a module and its `*.dist-info` (METADATA and
entry_points.txt) in a directory on sys.path, which importlib.metadata reads as it reads
any installed distribution.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from marl.rewards import functions
from marl.spec import code_refs
from marl.spec.code_refs import CodePolicy
from marl.spec.run import SpecError, load_spec_text, parse_spec
from marl.spec.safe_input import load_yaml
from marl.spec.services import load_service_config
from marl.workflows import registry
from marl.workflows.tools import Tool, named_tool

PACKAGE = '''
from marl.workflows import Workflow
from marl.workflows.tools import tool


async def _run(episode, problem):
    return ""


FLOW = Workflow(name="installed_flow", roles=("generator",), run=_run)
OTHER = Workflow(name="not_registered", roles=("generator",), run=_run)


def score(problem, answer, episode):
    return 1.0


@tool
def shout(text: str) -> str:
    "Upper case."
    return text.upper()
'''


@pytest.fixture()
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """`marlplugin_t`, installed with one entry point in each of marl's groups."""
    (tmp_path / "marlplugin_t.py").write_text(PACKAGE)
    info = tmp_path / "marlplugin_t-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: marlplugin-t\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[marl.workflows]\nplugin_flow = marlplugin_t:FLOW\n\n"
        "[marl.rewards]\nplugin_score = marlplugin_t:score\n\n"
        "[marl.tools]\nshout = marlplugin_t:shout\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code_refs.entry_points.cache_clear()
    functions.resolve.cache_clear()
    yield "marlplugin_t"
    code_refs.entry_points.cache_clear()
    functions.resolve.cache_clear()
    sys.modules.pop("marlplugin_t", None)


def test_a_prefix_allows_itself_and_its_submodules_only() -> None:
    policy = CodePolicy(("mylab", "other.rewards"))
    assert policy.allows_module("mylab") and policy.allows_module("mylab.flows.deep")
    assert not policy.allows_module("mylab_evil") and not policy.allows_module("my")
    assert policy.allows_module("other.rewards.x") and not policy.allows_module("other")


def test_installed_entry_points_resolve_by_name_and_by_target(installed: str) -> None:
    nothing = CodePolicy()  # no module allowed: installed code only
    assert registry.resolve("plugin_flow", nothing).name == "installed_flow"
    assert registry.resolve(f"{installed}:FLOW", nothing).name == "installed_flow"
    assert functions.resolve("plugin_score", policy=nothing)(None, "", None) == 1.0
    assert named_tool("shout").fn("a") == "A"
    assert isinstance(named_tool("calculator"), Tool)
    with pytest.raises(SpecError, match="field `workflow`: module 'marlplugin_t' is not "
                                        "allowed.*group `marl.workflows`.*allowed_modules"):
        registry.resolve(f"{installed}:OTHER", nothing)  # the package registered FLOW only
    with pytest.raises(SpecError, match="no tool named 'marlplugin_t:shout'"):
        named_tool(f"{installed}:shout")  # tools go by name, never by module path


def test_a_refused_name_is_never_imported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    (tmp_path / "marl_never_imported.py").write_text("raise SystemExit(9)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for check in (lambda: registry.check("marl_never_imported:X", CodePolicy()),
                  lambda: functions.check_name("marl_never_imported:f", CodePolicy())):
        with pytest.raises(SpecError, match="is not allowed here"):
            check()
    assert "marl_never_imported" not in sys.modules


def test_marls_rewards_are_named_by_their_names_or_targets() -> None:
    for name in ("math_reward", "any_format_reward", functions.BUILTIN_MATH, "judge_reward"):
        functions.check_name(name, CodePolicy())
    assert functions.resolve("math_reward") is functions.resolve(functions.BUILTIN_MATH)
    with pytest.raises(SpecError, match="is not allowed here"):
        functions.check_name("marl.cli.__main__:main", CodePolicy())  # marl, but no built-in


@pytest.mark.parametrize("module", ["exits_at_import", "interrupts_at_import"])
def test_an_import_that_exits_is_a_spec_error(module: str) -> None:
    with pytest.raises(SpecError, match="field `workflow`: cannot import module"):
        registry.resolve(f"tests.integration.hostile.{module}:FLOW",
                         CodePolicy(("tests.integration.hostile",)))


def test_local_modules_are_the_directorys_python_modules(tmp_path: Path) -> None:
    for name in ("pkg", "data-files", ".hidden", "_private", "2x"):
        (tmp_path / name).mkdir()
    (tmp_path / "flows.py").write_text("")
    (tmp_path / "notes.txt").write_text("")
    assert code_refs.local_modules(tmp_path) == ("flows", "pkg")


def test_allowed_modules_and_roots_read_as_lists_from_flags_and_variables() -> None:
    env = {"MARL_LEARNER_ALLOWED_MODULES": "mylab, mylab2.flows",
           "MARL_LEARNER_OUT_DIR_ROOTS": "/data/a,/data/b"}
    cfg = load_service_config("learner", environ=env)
    assert cfg.allowed_modules == ["mylab", "mylab2.flows"]
    assert cfg.out_dir_roots == ["/data/a", "/data/b"]
    with pytest.raises(ValueError, match=r"allowed_modules.*\(from MARL_WORKFLOW_ALLOWED_MODULES\)"):
        load_service_config("workflow", environ={"MARL_WORKFLOW_ALLOWED_MODULES": "a-b"})
    with pytest.raises(ValueError, match="judge_endpoints"):
        load_service_config("workflow", environ={"MARL_WORKFLOW_JUDGE_ENDPOINTS": "file:///x"})


BOMB = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi", strict=True))


def test_yaml_anchors_and_aliases_are_refused_at_once(tmp_path: Path) -> None:
    """Nine levels of nine aliases (9^9 strings expanded): refused at the first anchor."""
    started = time.monotonic()
    with pytest.raises(SpecError, match="anchors and aliases"):
        load_spec_text(BOMB)
    assert time.monotonic() - started < 1.0
    with pytest.raises(ValueError, match=r"line 2, column 4"):
        load_yaml("a: 1\nb: *x\n", "t")
    config = tmp_path / "learner.yaml"
    config.write_text("runs_dir: &r /tmp/x\n")
    with pytest.raises(ValueError, match="anchors and aliases"):
        load_service_config("learner", str(config), environ={})


@pytest.mark.parametrize("field, value", [
    ("grpo.group_size", 1_000_000), ("train.steps", 10**9), ("train.problems_per_step", 10**6),
    ("sampling.max_tokens", 10**9), ("caps.voting_candidates", 10_000),
    ("grpo.max_tokens_per_micro_batch", 10**12), ("train.checkpoints_kept", 10**6),
    ("reward.judge.max_tokens", 10**9), ("data.max_tests", 10**7), ("seed", -1),
])
def test_every_count_and_size_has_an_upper_bound(field: str, value: int) -> None:
    section, _, key = field.rpartition(".")
    data: dict = {key: value}
    for part in reversed(section.split(".") if section else []):
        data = {part: data}
    with pytest.raises(SpecError, match=f"field `{field}`"):
        parse_spec(data)


def test_tasks_per_step_are_bounded_together() -> None:
    with pytest.raises(SpecError, match="tasks a step"):
        parse_spec({"train": {"problems_per_step": 65536}, "grpo": {"group_size": 1024}})
