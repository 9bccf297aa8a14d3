"""A function past one screen is a set of parts waiting for names (docs: STYLE.md, point 16):
no function or method of the libraries is longer than MAX_LINES, and the rank program stays a
main and a fit loop composed from training/rank/."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = ("data_catalog", "preprocessing", "training")
MAX_LINES = 120
WORKER_MAX_LINES = 250


def long_functions(root: Path, packages: tuple[str, ...], limit: int) -> list[str]:
    """``path:line name (N lines)`` of every function longer than ``limit`` lines, decorators
    and docstring included."""
    found = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                lines = (node.end_lineno or node.lineno) - first + 1
                if lines > limit:
                    where = path.relative_to(root)
                    found.append(f"{where}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_library_function_is_longer_than_one_screen() -> None:
    assert long_functions(ROOT, LIBRARIES, MAX_LINES) == []


def test_the_rank_program_reads_in_one_file() -> None:
    lines = len((ROOT / "training" / "worker.py").read_text().splitlines())
    assert lines <= WORKER_MAX_LINES, f"training/worker.py has {lines} lines"


def test_a_long_function_is_found(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "long.py").write_text(
        f"class C:\n    @staticmethod\n    def long():\n{body}\n"
        f"def short():\n    return 1\n".replace("\n    x", "\n        x")
    )
    assert long_functions(tmp_path, ("pkg",), MAX_LINES) == [
        f"pkg/long.py:3 long ({MAX_LINES + 2} lines)"
    ]
