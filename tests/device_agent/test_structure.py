"""The agent stands alone on a device: it imports nothing of the server."""

from __future__ import annotations

import ast
from pathlib import Path

AGENT = Path(__file__).resolve().parents[2] / "device_agent"


def _imports(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            modules.add(node.module)
    return modules


def test_the_agent_imports_nothing_of_the_server():
    found = {
        str(path.relative_to(AGENT.parent)): sorted(m for m in _imports(path) if m.split(".")[0] == "server")
        for path in sorted(AGENT.rglob("*.py"))
    }
    assert {path: modules for path, modules in found.items() if modules} == {}
