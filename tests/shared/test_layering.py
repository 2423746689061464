"""The structure of ``shared/``: the torch-free modules import without torch; and of every package: no module of
``shared/``, ``server/`` or ``device_agent/`` imports itself back, at module level or inside a function."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2] / "shared"

# What the server's routes and the REST client need, and what a device computes (its batches, the replay, a private
# step's noise): they must import (and work) where torch is not installed.
TORCH_FREE = (
    "shared.accounting",
    "shared.aggregate",
    "shared.b_file",
    "shared.backends",
    "shared.batch",
    "shared.calibration",
    "shared.data",
    "shared.defaults",
    "shared.errors",
    "shared.evaluate",
    "shared.files",
    "shared.lru",
    "shared.manifest",
    "shared.memory",
    "shared.model_files",
    "shared.noise",
    "shared.privacy",
    "shared.processes",
    "shared.replay",
    "shared.schedule",
    "shared.schemas",
    "shared.tasks",
    "shared.text_fields",
    "shared.train_log",
    "shared.zo_optim",
)

_NO_TORCH = """
import importlib.abc, sys

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"torch is not importable here (imported {name})")
        return None

sys.meta_path.insert(0, NoTorch())
for name in sys.argv[1:]:
    __import__(name)

import numpy as np
from shared.b_file import b_file_bytes, read_b_file  # the upload check runs in the server's request
from pathlib import Path
import tempfile
path = Path(tempfile.mkdtemp()) / "b.safetensors"
path.write_bytes(b_file_bytes(np.arange(3, dtype=np.float32)))
assert read_b_file(path, 3).tolist() == [0.0, 1.0, 2.0]
assert "torch" not in sys.modules
"""


def test_torch_free_modules_import_without_torch() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _NO_TORCH, *TORCH_FREE], capture_output=True, text=True, cwd=SHARED.parent
    )
    assert result.returncode == 0, result.stderr


def _module_name(path: Path) -> str:
    parts = path.relative_to(SHARED.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, modules: set[str]) -> set[str]:
    """The package's modules an import statement names (``from shared import x`` names ``shared.x``)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
    else:
        return set()
    found = set()
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name:
            found.add(name)
    return found


def import_graph(package: str = "shared") -> dict[str, set[str]]:
    """Module → the modules of ``package`` it imports anywhere in its body (module level and inside functions: an
    import deferred into a function to dodge a cycle is still one)."""
    files = {_module_name(p): p for p in (SHARED.parent / package).rglob("*.py")}
    modules = set(files)
    graph = {}
    for name, path in files.items():
        edges = set().union(*(_imported(n, modules) for n in ast.walk(ast.parse(path.read_text()))))
        graph[name] = edges - {name, package}  # a package's __init__ reached through ``from package import x``
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for child in sorted(graph[node]):
            if state.get(child) == 1:
                return path[path.index(child) :] + [child]
            if child not in state and (cycle := visit(child, path + [child])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


@pytest.mark.parametrize(
    ("package", "edge"),
    [
        ("shared", ("shared.data", "shared.tasks")),
        ("server", ("server.metrics", "server.queries")),
        ("device_agent", ("device_agent.backends.runner", "device_agent.backends")),
    ],
)
def test_no_package_has_an_import_cycle(package: str, edge: tuple[str, str]) -> None:
    graph = import_graph(package)
    assert edge[1] in graph[edge[0]]  # the graph sees imports
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_algorithm_does_not_load_data() -> None:
    graph = import_graph()
    for module in ("shared.zo", "shared.program", "shared.baselines", "shared.replay"):
        assert "shared.data" not in graph[module], module


def test_one_export_pipeline():
    """Only ``shared.lowering`` traces, lowers and emits ExecuTorch programs: a second ``lower`` would drift (each
    program kind gives it only its module, methods and weight rule)."""
    repo = SHARED.parent
    stages = ("torch.export.export", "to_edge_transform_and_lower", "to_executorch", "ExecutorchBackendConfig")
    found = {
        str(path.relative_to(repo)): [
            stage for stage in stages if re.search(rf"(?<!\w){re.escape(stage)}(?!\w)", path.read_text())
        ]
        for part in ("shared", "server", "device_agent", "benchmarks", "mobizo")
        for path in sorted((repo / part).rglob("*.py"))
    }
    assert found.pop("shared/lowering.py") == list(stages), "the scan no longer sees the pipeline's own stages"
    assert {path: hits for path, hits in found.items() if hits} == {}


# The product's functions over 60 lines: two argparse builders (one option per statement), the ExecuTorch patches
# (one swap per attribute) and the Celery app's configuration. A new one is split before it lands.
LONG_FUNCTIONS = {
    "shared/commands/train.py:add_arguments",
    "server/commands/jobs.py:_add_submit",
    "shared/et_patches.py:_less_bookkeeping",
    "server/celery_queue.py:make_celery",
}


def test_product_functions_stay_short() -> None:
    long = set()
    for package in ("shared", "server", "device_agent", "mobizo"):
        for path in (SHARED.parent / package).rglob("*.py"):
            if "migrations" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 60:
                    long.add(f"{path.relative_to(SHARED.parent).as_posix()}:{node.name}")
    assert long <= LONG_FUNCTIONS, sorted(long - LONG_FUNCTIONS)
    assert len(long) <= 5
