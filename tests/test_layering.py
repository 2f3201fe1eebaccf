"""The floors of the house stay apart: no import circle among the distribution's modules
(function-level and ``TYPE_CHECKING`` imports included), and the core never imports the
services, the commands or the benchmarks above it. The graph is read from the source by
:mod:`pdserve.tools.imports` (nothing is imported); a failure names each circle's modules and
one cycle through it, edge by edge with file and line, so it says what to cut."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.tools.imports import (
    build_graph,
    cycle_through,
    describe_component,
    strongly_connected,
    upward_imports,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def graph():
    return build_graph(ROOT)


def test_the_graph_covers_the_distribution(graph) -> None:
    """The scan sees the core, the re-rooted services and their imports (a scan that found
    nothing would pass every other test here)."""
    assert "pdserve.config" in graph.modules
    assert "pdserve.services.router.orchestrator" in graph.modules
    assert "pdserve.v1.kvstore_pb2" not in graph.modules
    assert len(graph.modules) > 200
    assert graph.edge_count() > 2 * len(graph.modules)


def test_no_import_circle(graph) -> None:
    components = strongly_connected(graph)
    report = "\n".join(describe_component(graph, c) for c in components)
    assert not components, f"{len(components)} import circle(s); cut one edge of each:\n{report}"


def test_the_core_never_imports_an_upper_floor(graph) -> None:
    """No exception: the last one (procs -> commands.up_isolation) was cut with this test."""
    upward = [str(e) for e in upward_imports(graph)]
    assert not upward, "the core imports the services/commands/bench:\n" + "\n".join(upward)


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_edges_follow_every_kind_of_import(tmp_path: Path) -> None:
    """Function-level, relative, ``from pkg import module``, ``TYPE_CHECKING`` and re-rooted
    ``services`` imports are edges; an import of an own enclosing package is none."""
    root = _tree(
        tmp_path,
        {
            "pdserve/__init__.py": "",
            "pdserve/a.py": "def f():\n    from pdserve import b\n",
            "pdserve/b.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .pkg.c import X\n"
            ),
            "pdserve/pkg/__init__.py": "",
            "pdserve/pkg/c.py": "from .. import a\nfrom . import d\nimport pdserve.pkg\n",
            "pdserve/pkg/d.py": "from pdserve.pkg.c import name\nimport os\n",
            "pdserve/v1/x_pb2.py": "import pdserve.a\n",
            "services/__init__.py": "",
            "services/router/__init__.py": "",
            "services/router/r.py": "from ..router import s\n",
            "services/router/s.py": "from pdserve.services.router.r import f\n",
        },
    )
    graph = build_graph(root)
    edges = {name: sorted(targets) for name, targets in graph.edges.items() if targets}
    assert edges == {
        "pdserve.a": ["pdserve.b"],
        "pdserve.b": ["pdserve.pkg.c"],
        "pdserve.pkg.c": ["pdserve.a", "pdserve.pkg.d"],
        "pdserve.pkg.d": ["pdserve.pkg.c"],
        "pdserve.services.router.r": ["pdserve.services.router.s"],
        "pdserve.services.router.s": ["pdserve.services.router.r"],
    }
    assert strongly_connected(graph) == [
        ["pdserve.a", "pdserve.b", "pdserve.pkg.c", "pdserve.pkg.d"],
        ["pdserve.services.router.r", "pdserve.services.router.s"],
    ]
    cycle = cycle_through(graph, ["pdserve.a", "pdserve.b", "pdserve.pkg.c", "pdserve.pkg.d"])
    assert [(e.source, e.target, e.line) for e in cycle] == [
        ("pdserve.a", "pdserve.b", 2),
        ("pdserve.b", "pdserve.pkg.c", 3),
        ("pdserve.pkg.c", "pdserve.a", 1),
    ]
    assert [str(e) for e in upward_imports(graph)] == []


def test_an_upward_import_is_found(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "pdserve/__init__.py": "",
            "pdserve/core.py": "def f():\n    import pdserve.commands.up\n",
            "pdserve/commands/__init__.py": "",
            "pdserve/commands/up.py": "from pdserve import core\n",
            "services/__init__.py": "",
            "services/meta.py": "import pdserve.core\n",
        },
    )
    assert [str(e) for e in upward_imports(build_graph(root))] == [
        f"pdserve.core -> pdserve.commands.up ({Path('pdserve/core.py')}:2)"
    ]


def test_the_dry_run_prints_the_figures_and_fails_on_a_circle(tmp_path: Path, capsys) -> None:
    """``python -m pdserve.tools.imports ROOT``: exit 1 with the circle and the figures."""
    from pdserve.tools.imports import main

    files = {"pdserve/__init__.py": "", "pdserve/a.py": "import pdserve.b\n", "pdserve/b.py": ""}
    assert main([str(_tree(tmp_path / "clean", files))]) == 0
    assert "modules: 3; edges: 1; circles: 0 (sizes [])" in capsys.readouterr().out
    files["pdserve/b.py"] = "def f():\n    from pdserve import a\n"
    assert main([str(_tree(tmp_path / "circle", files))]) == 1
    out = capsys.readouterr().out
    assert "circle of 2 modules: pdserve.a, pdserve.b" in out
    assert f"pdserve.b -> pdserve.a ({Path('pdserve/b.py')}:2)" in out
    assert "circles: 1 (sizes [2])" in out
