"""The documentation stays honest: the generated reference covers every command, route and setting; the site builds
with ``mkdocs build --strict`` (the CI check); no page names a development machine's paths or an issue tracker's
numbers; the README stays a short entry point (the site holds the rest)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
HOOK = REPO / "docs" / "hooks" / "reference.py"
README_MAX_BYTES = 10_000  # one line and a link per result: the site holds the rest
BUILD_WARN_S = 20.0

DEV_PATH = re.compile(r"(?<![\w}.-])(?:/work/|/tmp/|/home/)|\.\./shared")  # a path, not /v1/work/…
ISSUE_REF = re.compile(r"\bissue\s+#?\d+|(?<![\w&#])#\d{2,}\b", re.IGNORECASE)
TEXT_SUFFIXES = {".md", ".py", ".yml", ".yaml", ".txt", ".html", ".css", ".js", ".json", ".toml", ".cfg"}


def _load_reference() -> ModuleType:
    name = "mobizo_docs_reference"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HOOK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def reference() -> ModuleType:
    return _load_reference()


@pytest.fixture(scope="module")
def app(reference: ModuleType):
    return reference.rest_app()


@pytest.fixture(scope="module")
def rest_sections(reference: ModuleType) -> dict[str, str]:
    return _sections(reference.rest_markdown())


# --- the generated reference covers everything ---------------------------------------------------------------------


def _sections(markdown: str) -> dict[str, str]:
    """Heading text -> the text up to the next heading."""
    sections: dict[str, str] = {}
    current, lines = "", []
    for line in markdown.splitlines():
        match = re.match(r"^#{1,6} (.+)$", line)
        if match:
            sections[current] = "\n".join(lines)
            current, lines = match.group(1).strip(), []
        else:
            lines.append(line)
    sections[current] = "\n".join(lines)
    return sections


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(path, parser) of every command below ``mobizo``, walked here independently of the generator."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from _commands(sub, (*path, name))


def test_every_command_is_in_the_cli_reference(reference: ModuleType) -> None:
    sections = _sections(reference.cli_markdown())
    missing = [" ".join(("mobizo", *path)) for path, _ in _commands(reference.cli_parser())]
    missing = [name for name in missing if name not in sections]
    assert not missing, f"commands missing from the CLI reference: {', '.join(missing)}"


NOT_OPTIONS = (argparse._SubParsersAction, argparse._HelpAction)  # sub-commands have sections; -h is said once


def test_every_visible_option_is_in_its_command_section(reference: ModuleType) -> None:
    sections = _sections(reference.cli_markdown())
    missing = []
    for path, parser in _commands(reference.cli_parser()):
        section = sections.get(" ".join(("mobizo", *path)), "")
        for action in parser._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, NOT_OPTIONS):
                continue
            for flag in action.option_strings or [action.metavar or action.dest]:
                if flag not in section:
                    missing.append(f"mobizo {' '.join(path)} {flag}")
    assert not missing, f"options missing from the CLI reference: {', '.join(missing)}"


def test_every_route_is_in_the_rest_reference(reference: ModuleType, app, rest_sections: dict[str, str]) -> None:
    routes = set(reference.routes(app))
    documented = {(m.upper(), p) for p, ops in app.openapi()["paths"].items() for m in ops}
    assert documented <= routes, f"OpenAPI paths the route walk missed: {sorted(documented - routes)}"
    missing = [f"{method} {path}" for method, path in sorted(routes) if f"{method} {path}" not in rest_sections]
    assert not missing, f"routes missing from the REST reference: {', '.join(missing)}"


def test_the_auth_column_knows_every_secured_route(reference: ModuleType, app) -> None:
    """A route that reads a bearer token names its kind (admin, user, device, ...); one that reads none says none."""
    kinds = reference._auth_kinds()
    auth = {
        (method, path): reference._auth(route, kinds)
        for path, route in reference._api_routes(app)
        for method in route.methods
    }
    unknown = sorted(f"{method} {path}" for (method, path), kind in auth.items() if kind == reference.UNKNOWN_AUTH)
    assert not unknown, f"routes whose auth kind the REST reference cannot name: {', '.join(unknown)}"
    secured = {
        (m.upper(), p) for p, ops in app.openapi()["paths"].items() for m, op in ops.items() if op.get("security")
    }
    bearer = {key: kind for key, kind in auth.items() if not key[1].startswith("/ui")}  # the dashboard's: below
    wrong = sorted(f"{m} {p}" for (m, p), kind in bearer.items() if (kind == "none") == ((m, p) in secured))
    assert not wrong, f"auth column disagrees with the OpenAPI security of: {', '.join(wrong)}"
    assert auth[("POST", "/v1/users")] == "admin" and auth[("POST", "/v1/leases")] == "device"
    assert auth[("POST", "/v1/jobs")] == "user" and auth[("POST", "/v1/devices")] == "none"


def test_the_dashboards_routes_say_session_and_csrf_and_retired_routes_are_not_operations(
    reference: ModuleType, app, rest_sections: dict[str, str]
) -> None:
    """A dashboard page needs the session cookie, a form that changes state its CSRF token too, the sign-in form
    only the token; the routes kept to answer 410 are listed once as retired, not as operations; every summary is
    the route's own (its docstring's first sentence), not FastAPI's title-cased function name."""
    kinds = reference._auth_kinds()
    auth = {(m, p): reference._auth(r, kinds) for p, r in reference._api_routes(app) for m in r.methods}
    session = "dashboard session (cookie)"
    assert auth[("GET", "/ui/jobs")] == session and auth[("GET", "/ui/devices")] == session
    for route in ("/ui/jobs/{job_id}/cancel", "/ui/devices/{device_id}/revoke", "/ui/logout"):
        assert auth[("POST", route)] == f"{session} + CSRF form token", route
    assert auth[("POST", "/ui/login")] == "CSRF form token" and auth[("GET", "/ui/login")] == "none"
    pages = [
        key for key in auth if key[1].startswith("/ui/") and key[1] not in ("/ui/", "/ui/login")
    ]  # "/ui/": a redirect
    assert pages and all(auth[key] != "none" for key in pages)

    gone = [(m, p) for p, r in reference._api_routes(app) if reference.retired(r) for m in r.methods - {"HEAD"}]
    assert ("GET", "/v1/jobs/{job_id}/program") in gone
    page = reference.rest_markdown()
    assert all(f"{m} {p}" not in rest_sections for m, p in gone)
    assert all(f"`{m} {p}`" in page.split("## Retired routes")[1] for m, p in gone)
    schema = app.openapi()
    defaults = [
        f"{m} {p}"
        for p, r in reference._api_routes(app)
        if not reference.retired(r)
        for m in r.methods - {"HEAD"}
        if reference.summary(r, schema["paths"].get(p, {}).get(m.lower(), {}))
        in (r.name.replace("_", " ").title(), r.name)
    ]
    assert not defaults, f"routes with no summary of their own: {', '.join(defaults)}"


def test_every_request_body_schema_is_in_the_rest_reference(app, rest_sections: dict[str, str]) -> None:
    schema = app.openapi()
    names = set()
    for operations in schema["paths"].values():
        for operation in operations.values():
            for media in operation.get("requestBody", {}).get("content", {}).values():
                names |= set(re.findall(r"#/components/schemas/(\w+)", str(media.get("schema", {}))))
    missing = sorted(names - set(rest_sections))
    assert names and not missing, f"request body schemas missing from the REST reference: {', '.join(missing)}"


def test_every_setting_is_in_the_settings_reference_with_a_description(reference: ModuleType) -> None:
    from server.settings import Settings

    markdown = reference.settings_markdown()
    missing = [name for name in Settings.model_fields if f"`{name}`" not in markdown]
    assert not missing, f"settings missing from the settings reference: {', '.join(missing)}"
    undescribed = [name for name, field in Settings.model_fields.items() if not (field.description or "").strip()]
    assert not undescribed, f"settings without a description= in server/settings.py: {', '.join(undescribed)}"
    env = [f"MOBIZO_{name.upper()}" for name in Settings.model_fields if name != "database_url"] + ["DATABASE_URL"]
    missing_env = [name for name in env if f"`{name}`" not in markdown]
    assert not missing_env, f"environment variables missing from the settings reference: {', '.join(missing_env)}"


def test_generated_pages_show_the_codes_defaults_not_this_machine(
    reference: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MOBIZO_SERVER", "http://leaked.example:1")
    monkeypatch.setenv("MOBIZO_TOKEN", "leaked-user-token")
    monkeypatch.setenv("MOBIZO_ADMIN_TOKEN", "leaked-admin-token")
    pages = {
        "cli": reference.cli_markdown(),
        "rest": reference.rest_markdown(),
        "settings": reference.settings_markdown(),
    }
    for name, markdown in pages.items():
        assert "leaked" not in markdown, f"the {name} reference shows this environment's values"
        for number, line in enumerate(markdown.splitlines(), 1):
            assert not DEV_PATH.search(line) and str(REPO) not in line, f"generated {name}.md:{number}: {line}"
    assert os.environ["MOBIZO_TOKEN"] == "leaked-user-token", "the generator must give the environment back"


# --- hygiene of the tracked pages ----------------------------------------------------------------------------------


def _tracked(*paths: str) -> list[Path]:
    done = subprocess.run(["git", "ls-files", "--", *paths], cwd=REPO, capture_output=True, text=True, check=True)
    return [REPO / line for line in done.stdout.splitlines() if line]


def _offences(files: list[Path]) -> list[str]:
    found = []
    for path in files:
        if path.suffix not in TEXT_SUFFIXES or not path.is_file():
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for pattern, what in ((DEV_PATH, "development path"), (ISSUE_REF, "issue reference")):
                match = pattern.search(line)
                if match:
                    found.append(f"{path.relative_to(REPO)}:{number}: {what} {match.group(0)!r}")
    return found


def test_docs_name_no_development_paths_or_issue_numbers() -> None:
    offences = _offences(_tracked("docs", "mkdocs.yml"))
    assert not offences, "\n".join(["pages must read the same on any machine:", *offences])


def test_readme_names_no_development_paths_or_issue_numbers() -> None:
    offences = _offences(_tracked("README.md"))
    assert not offences, "\n".join(["the README must read the same on any machine:", *offences])


def test_readme_is_at_most_10_kb() -> None:
    size = (REPO / "README.md").stat().st_size
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes (at most {README_MAX_BYTES}: the site holds the rest)"


# --- the site ------------------------------------------------------------------------------------------------------


def _nav_files(nav: list) -> list[str]:
    files = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        files += _nav_files(value) if isinstance(value, list) else [value]
    return files


def _nav_section(nav: list, title: str) -> list:
    (section,) = [entry[title] for entry in nav if isinstance(entry, dict) and title in entry]
    return section


def test_each_reference_stub_holds_its_marker_and_a_stub_without_it_fails_the_build(reference: ModuleType) -> None:
    from mkdocs.exceptions import PluginError

    def page(src: str) -> SimpleNamespace:
        return SimpleNamespace(file=SimpleNamespace(src_uri=src))

    for src, marker in reference.MARKERS.items():
        assert marker in (REPO / "docs" / src).read_text(encoding="utf-8"), f"docs/{src} lost its marker {marker}"
    with pytest.raises(PluginError, match="marker"):
        reference.on_page_markdown("# Settings\n", page("reference/settings.md"), None, None)
    assert reference.on_page_markdown("# Home\n", page("index.md"), None, None) == "# Home\n"


def test_the_jobs_defaults_table_is_rendered_from_shared_defaults(reference: ModuleType, monkeypatch) -> None:
    """Every cell of the defaults table is the code's value: change a default and the page changes with it."""
    from dataclasses import replace

    from shared import defaults

    def rows() -> dict[str, list[str]]:
        lines = [line.split(" | ") for line in reference.defaults_markdown().splitlines() if line.startswith("| ")]
        return {f"{cells[0][2:]} {cells[1]}": cells[2:] for cells in lines}

    classification = rows()["classification `mobizo`, `mezo-lora`"]
    tuned = defaults.for_method("mobizo", objective="classification")
    assert classification[:2] == [reference._number(tuned.lr), f"{tuned.lr_schedule} to 0"]
    assert classification[3:] == [
        str(tuned.steps),
        f"{tuned.rank} ({reference._number(defaults.alpha_for(tuned.rank))}) |",
    ]
    monkeypatch.setattr(defaults, "CLASSIFICATION", replace(defaults.CLASSIFICATION, lr=7e-3, steps=123))
    moved = rows()["classification `mobizo`, `mezo-lora`"]
    assert moved[0] == "7e-3" and moved[3] == "123"
    assert f"| batch size | {defaults.BATCH_SIZE}, in length buckets of {defaults.BUCKET} batches |" in (
        reference.defaults_markdown()
    )


SETTING_IN_PROSE = re.compile(r"`MOBIZO_([A-Z0-9_]+)` \((\d+(?:\.\d+)?)( KiB/s| s| h)?\)")


def test_a_setting_quoted_with_its_default_in_prose_quotes_the_codes_default() -> None:
    """``MOBIZO_X`` (N) in a page or the README: N (in its unit) is ``Settings.x``'s default, so prose that names a
    setting's default cannot drift from the code (the settings reference is generated from it)."""
    from server.settings import Settings

    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    quoted = [(page, m) for page in pages for m in SETTING_IN_PROSE.finditer(page.read_text(encoding="utf-8"))]
    assert len(quoted) >= 10  # the pattern still finds the guides' quotes
    wrong = []
    for page, m in quoted:
        field = Settings.model_fields[m[1].lower()]
        value = float(m[2]) * (1024 if m[3] == " KiB/s" else 1)
        if field.default != value:
            wrong.append(f"{page.relative_to(REPO)}: {m[0]} but the default is {field.default}")
    assert not wrong, "\n".join(wrong)


def test_the_server_guides_body_caps_are_the_codes() -> None:
    from server.limits import ENROLL_LIMIT, JSON_LIMIT
    from server.settings import Settings

    text = (REPO / "docs" / "guide" / "server.md").read_text(encoding="utf-8")
    caps = f"{JSON_LIMIT // 1024} KB for JSON requests, {ENROLL_LIMIT // 1024} KB for `POST /v1/devices`"
    assert caps in text
    assert f"`MOBIZO_MAX_UPLOAD_MB`, {Settings.model_fields['max_upload_mb'].default:g})" in text


def test_nav_has_a_page_per_benchmark_script_and_every_page_exists() -> None:
    from mkdocs.utils.yaml import yaml_load

    nav = yaml_load((REPO / "mkdocs.yml").read_text(encoding="utf-8"))["nav"]
    scripts = sorted(p.stem for p in (REPO / "benchmarks").glob("*.py") if p.stem != "__init__")
    want = ["benchmarks/index.md", *(f"benchmarks/{name}.md" for name in scripts)]
    assert _nav_files(_nav_section(nav, "Benchmarks")) == want, "Benchmarks nav: index, then one page per script"
    absent = [page for page in _nav_files(nav) if not (REPO / "docs" / page).is_file()]
    assert not absent, f"nav entries without a page: {', '.join(absent)}"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as CI builds it: ``mkdocs build --strict`` (any warning fails it) → its folder."""
    site = tmp_path_factory.mktemp("docs") / "site"
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(site)],
        cwd=REPO,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # Material's end-of-life banner: a print, not a warning
        capture_output=True,
        text=True,
    )
    seconds = time.monotonic() - started
    assert done.returncode == 0, f"mkdocs build --strict failed ({seconds:.1f} s):\n{done.stdout}\n{done.stderr}"
    over = f" (over {BUILD_WARN_S:.0f} s)" if seconds > BUILD_WARN_S else ""
    print(f"mkdocs build --strict: {seconds:.1f} s{over}")
    return site


def test_mkdocs_build_strict(site: Path) -> None:
    """The CI check: any warning (a broken link or anchor, a page missing from the nav, a stub without its marker)
    fails the build; the generated references are generated."""
    for page, text in (("cli", "mobizo jobs submit"), ("rest", "/v1/work/{work}/result"), ("settings", "MOBIZO_")):
        built = (site / "reference" / page / "index.html").read_text(encoding="utf-8")
        assert text in built and "<!-- generated:" not in built, f"reference/{page}.md was not generated"
    assert not (site / "hooks").exists(), "the hook module must not be published"


def test_the_site_asks_no_other_host_and_draws_its_diagrams_offline(site: Path) -> None:
    """Every page's scripts and stylesheets are the site's own files (Mermaid is served with the site,
    ``docs/hooks/mermaid.py``; the fonts are the system's), and in a real browser that can reach no host at all
    every Mermaid diagram of every page draws: a diagram Mermaid cannot parse stays an empty box."""
    from tests.utils.browser import chromium

    pages = sorted(site.rglob("*.html"))
    linked = {
        ref
        for page in pages
        for ref in re.findall(r'<(?:script|link)[^>]*\s(?:src|href)="([^"]+)"', page.read_text())
        if not re.search(r'rel="(?:canonical|alternate)"', ref)
    }
    assert linked and not [ref for ref in linked if re.match(r"(?i)(https?:)?//", ref)], sorted(linked)
    drawn = [page for page in pages if 'class="mermaid"' in page.read_text()]
    assert drawn, "no page holds a diagram"
    heights = {}
    with chromium("--host-resolver-rules=MAP * ~NOTFOUND") as browser:
        for page in drawn:
            browser.get(page.as_uri())
            deadline = time.monotonic() + 30
            while True:  # Mermaid draws after the page has loaded
                boxes = browser.execute_script(
                    "return Array.from(document.querySelectorAll('div.mermaid'), d => d.getBoundingClientRect().height)"
                )
                if (boxes and min(boxes) > 50) or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            heights[str(page.relative_to(site))] = boxes
            errors = [e["message"] for e in browser.get_log("browser") if "mermaid" in e["message"].lower()]
            assert not errors, errors
    assert all(boxes and min(boxes) > 50 for boxes in heights.values()), heights


# A dotted name of the project's code in a page's prose: ``shared.zo.zo_step``, ``server.verify``, ...
DOTTED_NAME = re.compile(r"(?<![\w./-])((?:shared|server|device_agent|benchmarks)(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
# the last part of a file's name (server.log), or the placeholder of a command line (python -m benchmarks.NAME)
NOT_A_NAME = {"py", "md", "json", "jsonl", "txt", "toml", "yml", "yaml", "sh", "lock", "log", "NAME"}


def _resolves(name: str) -> bool:
    """``name`` is a module of the project, or an attribute reached from one: a class's, or a field a dataclass or
    a pydantic model declares (an instance's, not the class's)."""
    import importlib

    parts = name.split(".")
    if parts[-1] in NOT_A_NAME:
        return True
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for attr in parts[split:]:
            fields = {*getattr(obj, "__dataclass_fields__", ()), *(getattr(obj, "model_fields", None) or ())}
            if attr in fields:
                return True
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_the_docs_dotted_names_resolve() -> None:
    """Every dotted name of the code in the docs' prose (``shared.foo.bar``, ``server.x``) is still a module or an
    attribute of one: a renamed function, a moved class or a deleted constant fails here, naming the page."""
    stale = sorted(
        f"{page.relative_to(REPO)}: {name}"
        for page in (REPO / "docs").rglob("*.md")
        for name in set(DOTTED_NAME.findall(page.read_text()))
        if not _resolves(name)
    )
    assert not stale, "\n".join(stale)
