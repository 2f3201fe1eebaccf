"""The router depends on the shared request types (pdserve.requests), never on the engines:
read from every router module's imports (ast), so a lazy import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

ROUTER = Path(__file__).resolve().parents[2] / "services" / "router"


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_the_router_imports_nothing_from_the_engines() -> None:
    files = sorted(ROUTER.rglob("*.py"))
    assert files
    found = {
        f"{path.relative_to(ROUTER)}: {name}"
        for path in files
        for name in _imports(path)
        if name == "pdserve.engines" or name.startswith("pdserve.engines.")
    }
    assert not found, sorted(found)
