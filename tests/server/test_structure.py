"""The server's structure stays as designed: one package writes a job's state, routes write nothing themselves (the
state layer does: ``server.state``, ``server.accounts``, under one transaction rule) and build no query (the reads
are ``server.queries``), routes never import routes, and no module grows past ``MAX_LINES``."""

from __future__ import annotations

import ast
from pathlib import Path

SERVER = Path(__file__).resolve().parents[2] / "server"
STATE = SERVER / "state"  # the job state machine, one module per subsystem
STATE_MODULES = sorted(STATE.glob("*.py"))
STATE_LAYER = [*STATE_MODULES, SERVER / "accounts.py"]
# The modules of handlers: the REST routes and the dashboard's pages.
HANDLERS = sorted((SERVER / "routes").glob("*.py")) + [SERVER / "dashboard" / "pages.py"]


def _status_writes(tree: ast.AST) -> list[int]:
    """Lines that set a status: ``x.status = ...`` (also in a tuple), ``.values(status=...)`` or
    ``.values({"status": ...})``, and ``Job(..., status=...)``."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names = target.elts if isinstance(target, ast.Tuple) else [target]
                lines += [node.lineno for t in names if isinstance(t, ast.Attribute) and t.attr == "status"]
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("values", "Job"):
                lines += [node.lineno for k in node.keywords if k.arg == "status"]
                for arg in node.args:
                    if isinstance(arg, ast.Dict) and any(
                        isinstance(k, ast.Constant) and k.value == "status" for k in arg.keys
                    ):
                        lines.append(node.lineno)
    return lines


def test_only_the_state_machine_writes_job_status():
    writers = {path.stem for path in STATE_MODULES if _status_writes(ast.parse(path.read_text()))}
    assert {"jobs", "leases", "sessions", "rounds", "closes"} <= writers, "the scan no longer sees the state's writes"
    writes = {
        str(path.relative_to(SERVER.parent)): lines
        for path in sorted(SERVER.rglob("*.py"))
        if path.parent != STATE and (lines := _status_writes(ast.parse(path.read_text())))
    }
    assert writes == {}, f"Job.status is written outside server/state/: {writes}"


def _imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = "server.routes" if node.level else node.module or ""
            modules |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return modules


def test_no_route_module_imports_another():
    routes = {path.stem for path in (SERVER / "routes").glob("*.py") if path.stem != "__init__"}
    assert {"jobs", "leases", "work", "adapters"} <= routes
    crossings = {
        stem: sorted(m for m in _imported_modules(SERVER / "routes" / f"{stem}.py") if m.startswith("server.routes"))
        for stem in routes
    }
    assert {stem: found for stem, found in crossings.items() if found} == {}


WRITES = {"add", "add_all", "delete", "merge", "update", "insert"}  # session methods and SQL statement builders


def _writes(tree: ast.AST) -> list[str]:
    """``session.add(...)``-style calls, ``update(...)``/``insert(...)``/``delete(...)`` statements, and assignments
    to attributes of loaded rows (``row.left_at = ...``: any attribute but a response's ``status_code``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in WRITES:
                found.append(f"{node.lineno}: {name}()")
        if isinstance(node, ast.Assign):
            for target in node.targets:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(t, ast.Attribute) and t.attr != "status_code":
                        found.append(f"{node.lineno}: .{t.attr} =")
    return found


def test_routes_write_nothing_themselves():
    assert _writes(ast.parse((SERVER / "accounts.py").read_text())), "the scan no longer sees the state layer's writes"
    writes = {path.name: found for path in HANDLERS if (found := _writes(ast.parse(path.read_text())))}
    assert writes == {}, f"route modules write outside the state layer (server.state, server.accounts): {writes}"


def _calls(fn: ast.FunctionDef) -> set[str]:
    return {
        node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        for node in ast.walk(fn)
        if isinstance(node, ast.Call)
    }


def _executes_a_prebuilt_statement(fn: ast.FunctionDef) -> bool:
    """``conn.execute(_HEARTBEAT, ...)``: a write built once at import (a module constant)."""
    return any(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "execute"
        and node.args
        and any(isinstance(n, ast.Name) and n.id.lstrip("_").isupper() for n in ast.walk(node.args[0]))
        for node in ast.walk(fn)
    )


def test_the_state_layer_follows_one_transaction_rule():
    """Each writer of ``server.state`` and ``server.accounts`` opens its unit of work (``begin_write``, which a
    step inside its caller's unit joins) and commits it (itself, through a helper of the layer that does, or as a
    ``with engine.begin()`` block), or is a step of a larger one and says "the caller commits" in its docstring."""
    broken, writers = [], 0
    modules = {
        path: [n for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)] for path in STATE_LAYER
    }
    everyone = [fn for functions in modules.values() for fn in functions]
    committing = {fn.name for fn in everyone if _calls(fn) & {"commit", "begin"}}
    opening = {fn.name for fn in everyone if _calls(fn) & {"begin_write", "begin"}}
    for path, functions in modules.items():
        for fn in functions:
            if fn.name.startswith("_"):
                continue
            calls = _calls(fn)
            if not (calls & WRITES or _executes_a_prebuilt_statement(fn)):
                continue
            writers += 1
            commits = bool(calls & (committing | {"commit", "begin"}))
            says = "the caller commits" in " ".join((ast.get_docstring(fn) or "").lower().split())
            if commits == says:  # neither, or both: the docstring must say which
                broken.append(f"{path.name}:{fn.name} (commits: {commits})")
            if not calls & (opening | {"begin_write", "begin"}):
                broken.append(f"{path.name}:{fn.name} (opens no unit of work)")
    assert writers >= 25, "the scan no longer sees the state layer's writers"
    assert broken == [], f"writers that break the transaction rule: {broken}"


def test_no_commit_outside_the_state_layer():
    """A request reads in autocommit and writes only in the state layer's transitions (``server.db``): no other
    module of ``server/`` commits (``server.db`` itself holds the session machinery and the startup lock)."""
    commits = {
        str(path.relative_to(SERVER.parent)): [
            node.lineno for node in ast.walk(ast.parse(path.read_text())) if _is_method_call(node)
        ]
        for path in sorted(SERVER.rglob("*.py"))
        if path not in (*STATE_LAYER, SERVER / "db.py")
    }
    assert any(_is_method_call(n) for n in ast.walk(ast.parse((STATE / "jobs.py").read_text()))), "the scan sees none"
    assert {name: lines for name, lines in commits.items() if lines} == {}


def _is_method_call(node: ast.AST, method: str = "commit") -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == method


def test_no_rollback_outside_the_state_layer():
    """A unit of work ends where it began: only the state layer's transitions roll back what they wrote (a lost race,
    a refused write), and ``server.db``, which ends a request's read and a failed request's unit; no route or service
    undoes a write it did not open."""
    rollbacks = {
        str(path.relative_to(SERVER.parent)): lines
        for path in sorted(SERVER.rglob("*.py"))
        if path not in (*STATE_LAYER, SERVER / "db.py")
        and (lines := [n.lineno for n in ast.walk(ast.parse(path.read_text())) if _is_method_call(n, "rollback")])
    }
    assert any(_is_method_call(n, "rollback") for n in ast.walk(ast.parse((STATE / "jobs.py").read_text())))
    assert rollbacks == {}, f"rollback() outside the state layer and server/db.py: {rollbacks}"


def test_routes_issue_no_query_of_their_own():
    """Lists, counts and lookups live in ``server.queries`` (writes in the state layer); a route calls them."""
    found = {
        path.name: [node.lineno for node in ast.walk(ast.parse(path.read_text())) if _is_select(node)]
        for path in HANDLERS
    }
    assert any(_is_select(node) for node in ast.walk(ast.parse((SERVER / "queries.py").read_text())))
    assert {name: lines for name, lines in found.items() if lines} == {}, "route modules build queries"


def _is_select(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and getattr(node.func, "id", None) == "select"


def _device_writes(tree: ast.AST) -> list[str]:
    """``update(Device)`` statements and assignments to a ``device`` row's attributes."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "update":
            if any(getattr(arg, "id", None) == "Device" for arg in node.args):
                found.append(f"{node.lineno}: update(Device)")
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Attribute) and getattr(t.value, "id", None) == "device":
                    found.append(f"{node.lineno}: device.{t.attr} =")
    return found


def test_the_device_row_has_one_writer():
    """What a device reports (backend, memory, CPU) and when it was last heard from are written by
    ``server.accounts`` alone, whichever route heard it (a lease, a heartbeat, any device request); its revocation
    by ``server.state.leases.revoke_device``, which releases its leases in the same transaction."""
    assert _device_writes(ast.parse((SERVER / "accounts.py").read_text())), "the scan no longer sees accounts' writes"
    writes = {
        str(path.relative_to(SERVER.parent)): found
        for path in sorted(SERVER.rglob("*.py"))
        if path.name != "accounts.py" and (found := _device_writes(ast.parse(path.read_text())))
    }
    assert writes.pop("server/state/leases.py", None) is not None, "the scan no longer sees the revocation"
    assert writes == {}, f"the Device row is written outside server/accounts.py: {writes}"


MAX_LINES = 500
# Modules over MAX_LINES, each with the reason it is not split yet; the list only shrinks.
LONG_MODULES: dict[str, str] = {}


def test_no_server_module_is_over_max_lines():
    """One module per subsystem, small enough to read whole: none of ``server/`` passes ``MAX_LINES``."""
    lines = {str(p.relative_to(SERVER.parent)): len(p.read_text().splitlines()) for p in SERVER.rglob("*.py")}
    assert len(lines) > 50 and max(lines.values()) > MAX_LINES // 2, "the scan no longer sees the server's modules"
    long = {path for path, count in lines.items() if count > MAX_LINES}
    assert long == set(LONG_MODULES), sorted(long ^ set(LONG_MODULES))
