"""Names that say one thing: no two modules of marl/ and services/ share a name that has
meant two things before, no module is named after a standard-library module, one class
is `Cluster`; no test module imports another test module or edits sys.path (shared
helpers live in tests/support)."""

from __future__ import annotations

import ast
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("marl", "services")
PYTHON_DIRS = (*PACKAGES, "tests", "bench", "scripts", "examples")
TEST_DIRS = ("tests", "bench")

AMBIGUOUS_MODULES = ("judge", "checks", "cluster", "episode", "report", "zygote", "config")
"""Basenames two modules once shared, each meaning something else."""
AMBIGUOUS_CLASSES = ("Cluster", "Judge")
TEST_MODULE = re.compile(r"^tests\.\w+\.(test_\w+|conftest)$")
TEST_MODULE_IN_CODE = re.compile(r"(?:from|import)\s+(tests\.\w+\.(?:test_\w+|conftest))\b")


def python_files(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py"))


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def test_no_two_modules_share_an_ambiguous_name() -> None:
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in python_files(*PACKAGES):
        by_name[path.stem].append(module_name(path))
    shared = {name: by_name[name] for name in AMBIGUOUS_MODULES if len(by_name[name]) > 1}
    assert not shared, f"one module per name, named for what it holds: {shared}"


def test_one_class_per_ambiguous_class_name() -> None:
    where: dict[str, list[str]] = defaultdict(list)
    for path in python_files(*PACKAGES):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and node.name in AMBIGUOUS_CLASSES:
                where[node.name].append(f"{module_name(path)}.{node.name}")
    assert all(len(defs) == 1 for defs in where.values()), dict(where)
    assert where["Cluster"] == ["marl.local.launcher.Cluster"]


def test_no_module_or_package_shadows_the_standard_library() -> None:
    shadows = []
    for path in python_files(*PYTHON_DIRS):
        name = path.parent.name if path.stem == "__init__" else path.stem
        if name in sys.stdlib_module_names:
            shadows.append(str(path.relative_to(ROOT)))
    assert not shadows, f"named like a standard-library module: {shadows}"


def _imported_test_modules(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if TEST_MODULE.match(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            found += [n for n in names if TEST_MODULE.match(n)]
    return found


def _edits_sys_path(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Attribute)
            and node.func.value.attr == "path"
            and isinstance(node.func.value.value, ast.Name)
            and node.func.value.value.id == "sys"
        ):
            return True
    return False


def test_no_test_module_imports_another_or_edits_sys_path() -> None:
    imports, path_edits = {}, []
    for path in python_files(*TEST_DIRS):
        text = path.read_text()
        tree = ast.parse(text, str(path))
        # also in code a test runs in a child process (a string handed to `python -c`)
        found = sorted({*_imported_test_modules(tree), *TEST_MODULE_IN_CODE.findall(text)})
        if found:
            imports[str(path.relative_to(ROOT))] = found
        if _edits_sys_path(tree):
            path_edits.append(str(path.relative_to(ROOT)))
    assert not imports, f"move what they share into tests/support: {imports}"
    assert not path_edits, f"import through tests.support, not sys.path: {path_edits}"


def test_the_checks_find_what_they_look_for() -> None:
    """Each rule refuses a module written to break it."""
    t = "tests"  # spelled apart, so that this module's own text passes its scan
    tree = ast.parse(
        f"import sys\nimport {t}.unit.test_a\nfrom {t}.integration.test_b import f\n"
        f"from {t}.unit import test_c\nfrom {t}.support import cluster\n"
        "sys.path.insert(0, 'x')\n"
    )
    assert _imported_test_modules(tree) == [
        "tests.unit.test_a", "tests.integration.test_b", "tests.unit.test_c",
    ]
    assert _edits_sys_path(tree)
    assert not _edits_sys_path(ast.parse("import sys\nprint(sys.path[0])\n"))
    assert TEST_MODULE_IN_CODE.findall(f'CHILD = "from {t}.unit.test_x import run"') == [
        f"{t}.unit.test_x"
    ]
    assert not TEST_MODULE_IN_CODE.findall(f'CHILD = "from {t}.support.x import run"')
    assert {"math", "code", "trace", "http", "inspect"} <= set(sys.stdlib_module_names)
