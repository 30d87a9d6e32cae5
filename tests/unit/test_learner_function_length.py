"""The learner reads top to bottom in short parts: no function in services/learner/ is
longer than MAX_LINES (from its `def` to its last line, docstring included)."""

from __future__ import annotations

import ast
from pathlib import Path

import services.learner

MAX_LINES = 70


def long_functions(folder: Path, limit: int) -> list[str]:
    out = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    out.append(f"{path.name}:{node.lineno} {node.name} ({lines} lines)")
    return out


def test_no_learner_function_is_over_the_limit() -> None:
    folder = Path(services.learner.__file__).parent
    assert list(folder.glob("*.py")), folder
    too_long = long_functions(folder, MAX_LINES)
    assert not too_long, f"split these (over {MAX_LINES} lines): " + ", ".join(too_long)


def test_the_check_finds_a_long_function(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_LINES))
    (tmp_path / "long.py").write_text(f"def too_long() -> None:\n{body}")
    (tmp_path / "short.py").write_text("async def fine() -> None:\n    pass\n")
    assert long_functions(tmp_path, MAX_LINES) == [f"long.py:1 too_long ({MAX_LINES + 1} lines)"]
