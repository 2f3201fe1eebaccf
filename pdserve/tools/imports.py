"""The import graph of the pdserve distribution, and its circles.

``python -m pdserve.tools.imports [ROOT]`` prints the graph's size (modules, edges), every
strongly connected component (a set of modules that import each other, directly or not) with
one cycle through it, and every import from the core up into the services, the commands or the
benchmarks; it exits 1 when there is any. ``tests/test_layering.py`` asserts the same on every
``make check``.

What counts as an edge (read from the source with :mod:`ast`, nothing is imported):

* every ``import`` statement anywhere in a module, function-level and ``TYPE_CHECKING`` ones
  included (both still tie the modules together: the first at call time, the second for the
  reader and the type checker);
* ``import a.b.c`` is an edge to the longest of ``a.b.c``, ``a.b``, ``a`` that is a module of
  the distribution (a package is its ``__init__``);
* ``from pkg import name`` is an edge to ``pkg`` (Python runs its ``__init__`` first) and, when
  ``pkg.name`` is itself a module, one to ``pkg.name``; relative imports are resolved from the
  importing module's package;
* an import of one of the module's own enclosing packages is no edge (Python has run that
  ``__init__`` before the module anyway), nor is an import of itself;
* the enclosing packages of an imported module are not edges either (``import a.b.c`` runs
  ``a/b/__init__.py`` too, but is no edge to ``a.b``), as in the shared hook. Counting
  them would find one more circle today, through a ``TYPE_CHECKING`` import:
  ``router.engine_events`` -> ``router.policies.base`` (whose package's ``__init__`` imports
  ``engine_events``).

``services/`` is re-rooted as ``pdserve.services`` (``setup.py``); generated protobuf modules
(``*_pb2*.py``) are left out. The rules agree with the shared hook ``import_circles.py``.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

#: Source folder -> the dotted name it is imported under.
ROOTS = {"pdserve": "pdserve", "services": "pdserve.services"}
#: The floors above the core: the core (every other ``pdserve.*`` module) imports none of them.
UPPER = ("pdserve.services", "pdserve.commands", "pdserve.bench")


@dataclass(frozen=True)
class Edge:
    """One import: ``source`` imports ``target`` at ``path``:``line``."""

    source: str
    target: str
    path: Path
    line: int

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} ({self.path}:{self.line})"


@dataclass
class ImportGraph:
    """Modules (dotted name -> file) and, per importing module, its edges by target (the first
    import of each target in the file)."""

    modules: dict[str, Path]
    edges: dict[str, dict[str, Edge]] = field(default_factory=dict)

    def edge_count(self) -> int:
        return sum(len(targets) for targets in self.edges.values())

    def all_edges(self) -> list[Edge]:
        return [e for targets in self.edges.values() for e in targets.values()]


def module_name(path: Path, root: Path) -> str:
    """The dotted name ``path`` (a ``.py`` file under one of :data:`ROOTS` in ``root``) is
    imported under."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    parts[0] = ROOTS[parts[0]]
    return ".".join(parts)


def find_modules(root: Path) -> dict[str, Path]:
    """Every module of the distribution under ``root``, generated protobuf code left out."""
    found: dict[str, Path] = {}
    for folder in ROOTS:
        for path in sorted((root / folder).rglob("*.py")):
            if "_pb2" not in path.name:
                found[module_name(path, root)] = path.relative_to(root)
    return found


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest dotted prefix of ``name`` that is a module, or None (not ours)."""
    if name.startswith("services."):
        name = "pdserve." + name
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    """The dotted names one import statement in a module of ``package`` names."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = package.split(".")
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join([*parts, base] if base else parts)
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def build_graph(root: Path) -> ImportGraph:
    """Parse every module under ``root`` and collect its imports (the rules in the module
    docstring). A file that does not parse raises :class:`SyntaxError`."""
    graph = ImportGraph(find_modules(root))
    for name, rel in graph.modules.items():
        path = root / rel
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(rel))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out: dict[str, Edge] = {}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for dotted in _targets(node, package):
                target = _resolve(dotted, graph.modules)
                if target is None or target == name or name.startswith(target + "."):
                    continue
                edge = Edge(name, target, rel, node.lineno)
                if target not in out or edge.line < out[target].line:
                    out[target] = edge
        graph.edges[name] = out
    return graph


def strongly_connected(graph: ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted, largest first
    (Tarjan's algorithm, iterative: no recursion limit to hit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph.modules):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.edges.get(start, {}))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.edges.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found, key=lambda c: (-len(c), c))


def cycle_through(graph: ImportGraph, component: list[str]) -> list[Edge]:
    """One shortest cycle through the first module of ``component`` (a strongly connected
    component), as its edges: the path a fix has to cut somewhere."""
    members = set(component)
    start = component[0]
    came_from: dict[str, Edge] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for target, edge in sorted(graph.edges.get(node, {}).items()):
            if target not in members:
                continue
            if target == start:
                path = [edge]
                while path[0].source != start:
                    path.insert(0, came_from[path[0].source])
                return path
            if target not in came_from:
                came_from[target] = edge
                queue.append(target)
    raise ValueError(f"{component} is not strongly connected")


def is_core(module: str) -> bool:
    """Whether ``module`` is in the core (not in one of the :data:`UPPER` floors)."""
    return not any(module == top or module.startswith(top + ".") for top in UPPER)


def upward_imports(graph: ImportGraph) -> list[Edge]:
    """Every edge from the core up into :data:`UPPER`, sorted."""
    return sorted(
        (e for e in graph.all_edges() if is_core(e.source) and not is_core(e.target)),
        key=lambda e: (e.source, e.target),
    )


def describe_component(graph: ImportGraph, component: list[str]) -> str:
    """A component's modules and one cycle through it, one edge a line."""
    lines = [f"circle of {len(component)} modules: {', '.join(component)}", "  one cycle:"]
    lines += [f"    {edge}" for edge in cycle_through(graph, component)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.tools.imports", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "root",
        nargs="?",
        type=Path,
        default=Path(__file__).resolve().parents[2],
        help="the checkout holding pdserve/ and services/ (default: this one)",
    )
    args = parser.parse_args(argv)
    graph = build_graph(args.root)
    components = strongly_connected(graph)
    upward = upward_imports(graph)
    for component in components:
        print(describe_component(graph, component))
    for edge in upward:
        print(f"core imports upward: {edge}")
    sizes = [len(c) for c in components]
    print(
        f"modules: {len(graph.modules)}; edges: {graph.edge_count()}; "
        f"circles: {len(components)} (sizes {sizes}); core->upper imports: {len(upward)}"
    )
    return 1 if components or upward else 0


if __name__ == "__main__":
    sys.exit(main())
