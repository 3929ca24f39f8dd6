"""The layering of docs/design.md holds: each room of ``pagewarden/`` imports only from
the rooms below it, and no modules import each other in a circle.

Every ``import`` and ``from ... import`` in the package counts, at module level or inside
a function, type-only or not: a dependency is a dependency wherever it is written.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "pagewarden"

#: Rooms from top to bottom, as docs/design.md draws them. A room is a subpackage; the
#: first and last layers group top-level modules (named without ``pagewarden.``), which
#: may import each other.
LAYERS: list[tuple[str, ...]] = [
    ("__init__", "__main__", "cli", "terminal"),  # the package's front door and the CLI
    ("serve",),
    ("server",),
    ("chaos",),
    ("engine",),
    ("metrics",),
    ("faults",),
    ("worker",),
    ("sched",),
    ("kvstore",),
    ("kv",),
    ("models",),
    ("kernels",),
    # Leaves: stdlib-only modules every layer may use (metrics/stats.py is the stats
    # dataclasses; the exporter beside it sits in the metrics room).
    (
        "sampling_params",
        "structured_outputs",
        "version",
        "omp_policy",
        "private_dir",
        "metrics.stats",
    ),
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the pagewarden modules it imports (``from pkg import sub`` counts as an
    import of ``pkg.sub`` only)."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        is_package = path.name == "__init__.py"
        targets: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(resolve(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".")
                    base = base[: len(base) - node.level + (1 if is_package else 0)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    targets.add(sub if sub in paths else resolve(source))
        graph[module] = {t for t in targets if t and t.startswith("pagewarden") and t != module}
    return graph


def room(module: str) -> str:
    if module == "pagewarden.metrics.stats":
        return "metrics.stats"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_of(module: str) -> int:
    name = room(module)
    for index, rooms in enumerate(LAYERS):
        if name in rooms:
            return index
    raise AssertionError(f"{module}: room {name!r} is in no layer of LAYERS (docs/design.md)")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_room_is_in_a_layer() -> None:
    for module in import_graph():
        layer_of(module)


def test_rooms_import_only_from_rooms_below() -> None:
    graph = import_graph()
    upward = sorted(
        f"{a} -> {b}" for a, targets in graph.items() for b in targets if layer_of(b) < layer_of(a)
    )
    assert upward == [], "imports that point up in docs/design.md's layers"


def test_no_import_cycles() -> None:
    assert cycles(import_graph()) == []


def test_the_checks_see_what_they_look_for() -> None:
    """The graph sees a known import, the cycle finder a circle, and the layers a known
    downward edge: the three tests above could fail."""
    graph = import_graph()
    assert "pagewarden.sched.scheduler" in graph["pagewarden.engine.core"]
    assert "pagewarden.kv.audit" in graph["pagewarden.kv.kv_manager"]  # from kv import audit
    assert layer_of("pagewarden.engine.core") < layer_of("pagewarden.kv.block_pool")
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_design_md_draws_the_same_layers() -> None:
    """docs/design.md's diagram lists the subpackage rooms in the order of LAYERS."""
    design = (PACKAGE.parent / "docs" / "design.md").read_text()
    diagram = design.split("```")[1]
    drawn = [line.split("/")[0] for line in diagram.splitlines() if line[:1].isalpha()]
    drawn = [name for name in drawn if (PACKAGE / name).is_dir()]
    subpackages = [r for rooms in LAYERS for r in rooms if (PACKAGE / r).is_dir()]
    assert drawn == subpackages
