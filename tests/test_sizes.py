"""Files and functions that fit in a sitting (issue 30): no Python file in ``pagewarden/``
over 500 lines, no function over 80 (``ast``: ``end_lineno - lineno + 1``)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "pagewarden"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def long_functions(source: str) -> list[tuple[str, int]]:
    """(qualified name, lines) of every function in ``source`` over the limit."""
    found: list[tuple[str, int]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert child.end_lineno is not None
                n = child.end_lineno - child.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    found.append((prefix + child.name, n))
                walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    walk(ast.parse(source), "")
    return found


def test_no_python_file_over_500_lines() -> None:
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in sorted(PACKAGE.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert long == {}


def test_no_function_over_80_lines() -> None:
    long = {
        f"{p.relative_to(PACKAGE)}:{name}": n
        for p in sorted(PACKAGE.rglob("*.py"))
        for name, n in long_functions(p.read_text())
    }
    assert long == {}


def test_the_function_measure_sees_methods_and_nested_functions() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    source = f"class A:\n    def m(self):\n{body.replace('    ', '        ')}\n"
    source += f"def f():\n    def g():\n{body.replace('    ', '        ')}\n    return g\n"
    assert long_functions(source) == [("A.m", 81), ("f", 83), ("f.g", 81)]
