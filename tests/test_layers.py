"""The package's layers: which of ``sidecar``'s subpackages and top-level modules may import which.

Every import counts, wherever it is written: at the top, inside a function, under
``TYPE_CHECKING``, relative, or ``importlib.import_module("sidecar....")``. A unit is a
subpackage (``scheduling``) or a top-level module (``config``); ``from sidecar import
__version__`` is an import of the package's own ``__init__`` (unit ``sidecar``).

docs/architecture.md draws these layers.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import sidecar

ROOT = Path(sidecar.__file__).parent
PACKAGE = "sidecar"

LAYERS: tuple[tuple[str, frozenset[str]], ...] = tuple(
    (name, frozenset(units.split()))
    for name, units in (
        ("programs", "__main__ demo emulator inject llmd"),
        ("serving", "server"),
        ("application", "app admin"),
        ("request path", "pipeline passthrough relay framing paths headers"),
        ("connectors", "connectors"),
        ("around the engines", "kvevents security"),
        ("engines", "engines"),
        ("scheduling", "scheduling discovery"),
        (
            "foundation",
            "config observability body errors sanitize defaults caches tasks drain extras "
            + PACKAGE,
        ),
        ("vocabulary", "fleet"),
    )
)
"""Top first. A unit imports units of its own layer or of layers below it, never above."""
LEAF = "fleet"
"""The fleet's vocabulary: imports nothing of the sidecar's."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _unit(module: str) -> str:
    """``sidecar.a.b`` → ``a``; ``sidecar`` → ``sidecar``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else PACKAGE


def _is_unit(name: str) -> bool:
    return (ROOT / name).is_dir() or (ROOT / f"{name}.py").is_file()


def _imported(path: Path) -> Iterator[tuple[str, int]]:
    """Every ``sidecar`` module ``path`` imports, with its line."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == PACKAGE:  # from sidecar import config / __version__
                for alias in node.names:
                    name = alias.name
                    yield (f"{PACKAGE}.{name}" if _is_unit(name) else PACKAGE), node.lineno
            else:
                yield target, node.lineno
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.args[0].value, node.lineno


def import_graph() -> dict[str, dict[str, list[str]]]:
    """unit → unit it imports → where (``path:line``), self-imports left out."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(ROOT.rglob("*.py")):
        unit = _unit(_module_name(path))
        graph[unit]  # every unit is a node, importing or not
        for target, line in _imported(path):
            if target != PACKAGE and not target.startswith(PACKAGE + "."):
                continue
            other = _unit(target)
            if other != unit:
                graph[unit][other].append(f"{path.relative_to(ROOT.parent)}:{line}")
    return graph


def cycles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """The strongly connected components of more than one unit (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(unit: str) -> None:
        index[unit] = low[unit] = len(index)
        stack.append(unit)
        for other in graph.get(unit, {}):
            if other not in index:
                visit(other)
                low[unit] = min(low[unit], low[other])
            elif other in stack:
                low[unit] = min(low[unit], index[other])
        if low[unit] == index[unit]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == unit:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for unit in sorted(graph):
        if unit not in index:
            visit(unit)
    return found


def test_no_import_cycle_among_the_packages_units() -> None:
    graph = import_graph()
    report = [
        f"{' ↔ '.join(component)}: "
        + "; ".join(
            f"{a} → {b} ({', '.join(graph[a][b][:3])})"
            for a in component
            for b in component
            if b in graph[a]
        )
        for component in cycles(graph)
    ]
    assert report == []


def test_every_unit_has_its_layer() -> None:
    placed = [unit for _, units in LAYERS for unit in units]
    assert len(placed) == len(set(placed)), "a unit in two layers"
    assert set(import_graph()) == set(placed)


def test_a_layer_never_imports_one_above_it() -> None:
    rank = {unit: depth for depth, (_, units) in enumerate(LAYERS) for unit in units}
    upward = [
        f"{unit} ({LAYERS[rank[unit]][0]}) → {other} ({LAYERS[rank[other]][0]}): "
        + ", ".join(where)
        for unit, imports in import_graph().items()
        for other, where in imports.items()
        if unit in rank and other in rank and rank[other] < rank[unit]
    ]
    assert upward == []


def test_the_vocabulary_imports_nothing_of_the_sidecar() -> None:
    assert dict(import_graph()[LEAF]) == {}


def test_the_architecture_page_draws_these_layers() -> None:
    """docs/architecture.md's drawing: a line per layer, top first, its name in the first 20
    columns and then its units (a subpackage with its slash; continuation lines indented)."""
    page = (ROOT.parent / "docs" / "architecture.md").read_text()
    drawing = page.split("## Layers", 1)[1].split("```", 2)[1].strip("\n").splitlines()
    drawn: list[tuple[str, set[str]]] = []
    for line in drawing:
        name, words = line[:20].strip(), line[20:].split()
        if name:
            drawn.append((name, set()))
        drawn[-1][1].update(w.removesuffix("/").removesuffix("/__init__") for w in words)
    assert [name for name, _ in drawn] == [name for name, _ in LAYERS]
    for (name, units), (_, written) in zip(LAYERS, drawn, strict=True):
        assert units <= written, name
