"""The generated reference pages: the CLI, the REST API and the server's settings, rebuilt at every docs build.

An MkDocs hook (``hooks:`` in ``mkdocs.yml``): ``docs/reference/{cli,rest,settings}.md`` are short stubs holding a
marker line (``MARKERS``); ``on_page_markdown`` replaces it with what ``cli_markdown()``, ``rest_markdown()`` and
``settings_markdown()`` render from the code itself (mobizo's argparse tree, the FastAPI app's routes and OpenAPI
schema, ``server.settings.Settings``). A stub without its marker fails the build. The three functions are plain and
importable (``tests/test_docs.py`` checks that every command, route and setting is on its page).
"""

from __future__ import annotations

import argparse
import contextlib
import html
import json
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # mkdocs runs from the repository root, but the hook must not depend on it
    sys.path.insert(0, str(REPO))

MARKERS: dict[str, str] = {
    "reference/cli.md": "<!-- generated: cli -->",
    "reference/rest.md": "<!-- generated: rest -->",
    "reference/settings.md": "<!-- generated: settings -->",
    "guide/jobs.md": "<!-- generated: defaults -->",
}

# Environment variables that change what the code reports as a default (``--server``, ``--token``): the pages show
# the code's own defaults, never this machine's environment (nor a token in it).
_ENV_PREFIXES = ("MOBIZO_",)
_ENV_NAMES = ("DATABASE_URL",)


# --- Markdown helpers -----------------------------------------------------------------------------------------------


def _scrub(text: str) -> str:
    """Paths of this checkout and this user's home, as a reader's own: ``<checkout>/...`` and ``~/...``."""
    text = re.sub(rf"{re.escape(str(REPO))}(?![\w.-])", "<checkout>", text)
    home = str(Path.home())
    if home not in ("/", ""):
        text = re.sub(rf"{re.escape(home)}(?![\w.-])", "~", text)
    return text


_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
_MD_SPECIAL = re.compile(r"([\\*_\[\]|])")


def _text(text: str | None) -> str:
    """Prose from docstrings and help strings as one line of Markdown: code spans kept, everything else literal."""
    if not text:
        return ""
    text = " ".join(_scrub(str(text)).split())
    out, last = [], 0
    for match in _CODE_SPAN.finditer(text):
        out.append(_escape(text[last : match.start()]))
        out.append(match.group(0))  # a table's pipes inside a code span are not cell separators
        last = match.end()
    out.append(_escape(text[last:]))
    return "".join(out)


def _escape(text: str) -> str:
    return _MD_SPECIAL.sub(r"\\\1", html.escape(text, quote=False))


def _code(value: Any) -> str:
    """A value in a code span."""
    text = " ".join(_scrub(str(value)).split())
    if not text:
        return ""
    fence = "``" if "`" in text else "`"
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _anchor(heading: str) -> str:
    """The id the toc extension gives a heading of this text (its default slugify)."""
    from markdown.extensions.toc import slugify

    return slugify(heading, "-")


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell or " " for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _paragraphs(text: str | None) -> str:
    """A docstring as Markdown paragraphs (blank lines kept, each paragraph one line)."""
    if not text:
        return ""
    import inspect

    blocks = re.split(r"\n\s*\n", inspect.cleandoc(text))
    return "\n\n".join(_text(block.replace("``", "`")) for block in blocks if block.strip())


# --- CLI ------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _code_defaults_only() -> Iterator[None]:
    """Hide the environment variables the parser reads its defaults from, while it is built."""
    saved = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES) or k in _ENV_NAMES}
    for key in saved:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.update(saved)


def cli_parser() -> argparse.ArgumentParser:
    """mobizo's parser, built as ``mobizo`` builds it, with the code's defaults."""
    from mobizo.cli import build_parser

    with _code_defaults_only():
        return build_parser()


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser, str]]:
    """(name, parser, help) of each sub-command, in the parser's order; an alias is not a second command."""
    found, seen = [], set()
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {choice.dest: choice.help for choice in action._choices_actions}
        for name, sub in action.choices.items():
            if id(sub) in seen:
                continue
            seen.add(id(sub))
            found.append((name, sub, helps.get(name) or sub.description or ""))
    return found


def command_paths(parser: argparse.ArgumentParser | None = None) -> list[tuple[str, ...]]:
    """Every command path below ``mobizo``, groups included: ``("jobs",)``, ``("jobs", "submit")``, ..."""
    parser = parser or cli_parser()
    paths: list[tuple[str, ...]] = []

    def walk(p: argparse.ArgumentParser, prefix: tuple[str, ...]) -> None:
        for name, sub, _ in _subcommands(p):
            paths.append((*prefix, name))
            walk(sub, (*prefix, name))

    walk(parser, ())
    return paths


def _formatter(parser: argparse.ArgumentParser) -> argparse.HelpFormatter:
    return parser.formatter_class(prog=parser.prog, width=100)


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = _formatter(parser)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
    return _scrub(formatter.format_help().strip())


_NO_DEFAULT = (
    argparse._HelpAction,
    argparse._VersionAction,
    argparse._StoreTrueAction,
    argparse._StoreFalseAction,
    argparse._StoreConstAction,
    argparse._AppendConstAction,
)


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if isinstance(action, _NO_DEFAULT) or action.default in (None, argparse.SUPPRESS):
        return ""
    default = action.default
    if isinstance(default, (list, tuple)):
        default = " ".join(str(item) for item in default)
    return _code(default)


def _option_rows(parser: argparse.ArgumentParser) -> list[list[str]]:
    formatter = _formatter(parser)
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._SubParsersAction, argparse._HelpAction)) or action.help == argparse.SUPPRESS:
            continue
        invocation = formatter._format_action_invocation(action)
        help_text = formatter._expand_help(action) if action.help else ""
        if action.metavar is not None and action.choices is not None and not isinstance(action.choices, dict):
            choices = [str(choice) for choice in action.choices]  # hidden by the metavar: say them
            if not all(re.search(rf"\b{re.escape(choice)}\b", help_text) for choice in choices):
                help_text = f"{help_text} (one of: {', '.join(choices)})".lstrip()
        rows.append([_code(invocation), _default(action), _text(help_text)])
    return rows


def cli_markdown() -> str:
    """The CLI reference: each command path with its help, usage and options."""
    parser = cli_parser()
    parts = [
        _text(parser.description),
        "Every command takes `-h`/`--help`. Exit codes: 0 success, 2 bad arguments (the message names the "
        "argument), 1 any other failure, 130 interrupted.",
        "```text\n" + _usage(parser) + "\n```",
        _table(["command", "what it does"], _index_rows(parser, ())),
    ]

    def walk(p: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
        for name, sub, help_text in _subcommands(p):
            sub_path = (*path, name)
            level = "#" * min(len(sub_path) + 1, 6)
            parts.append(f"{level} mobizo {' '.join(sub_path)}")
            description = sub.description if sub.description and sub.description != help_text else ""
            parts.append(_text(help_text))
            if description:
                parts.append(_text(description))
            parts.append("```text\n" + _usage(sub) + "\n```")
            children = _subcommands(sub)
            if children:
                parts.append(_table(["sub-command", "what it does"], _index_rows(sub, sub_path)))
            rows = _option_rows(sub)
            if rows:
                parts.append(_table(["option", "default", "meaning"], rows))
            if sub.epilog:
                parts.append(_text(sub.epilog))
            walk(sub, sub_path)

    walk(parser, ())
    return "\n\n".join(part for part in parts if part) + "\n"


def _index_rows(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> list[list[str]]:
    rows = []
    for name, _, help_text in _subcommands(parser):
        full = " ".join(("mobizo", *path, name))
        rows.append([f"[`{full}`](#{_anchor(full)})", _text(help_text)])
    return rows


# --- REST -----------------------------------------------------------------------------------------------------------


def rest_app() -> Any:
    """The FastAPI app as ``mobizo server`` builds it, from the settings' defaults (no environment, nothing started:
    building it touches no database and no data dir)."""
    from server.app import create_app
    from server.settings import Settings

    return create_app(Settings.model_construct())


def _api_routes(app: Any) -> Iterator[tuple[str, Any]]:
    """(path, APIRoute) of every API route, routers included however deeply, and the routes of mounted
    applications (the dashboard at ``/ui``) under their mount's path."""
    from fastapi import routing
    from starlette.routing import Mount

    for route in app.routes:
        if isinstance(route, Mount) and hasattr(route.app, "routes"):
            yield from ((route.path + path, inner) for path, inner in _api_routes(route.app))

    iter_contexts = getattr(routing, "iter_route_contexts", None)
    if iter_contexts is not None:  # FastAPI keeps included routers as such and resolves their paths lazily
        for context in iter_contexts(app.routes):
            if isinstance(context.original_route, routing.APIRoute):
                yield context.path, context.original_route
    else:
        for route in app.routes:
            if isinstance(route, routing.APIRoute):
                yield route.path, route


def routes(app: Any | None = None) -> list[tuple[str, str]]:
    """(METHOD, path) of every API route of the app but the retired ones."""
    app = app or rest_app()
    return [
        (method, path)
        for path, route in _api_routes(app)
        if not retired(route)
        for method in sorted(route.methods)
        if method != "HEAD"
    ]


def _auth_kinds() -> dict[Callable[..., Any], str]:
    from server import deps
    from server.dashboard import web as ui

    return {
        deps.require_admin: "admin",
        deps.get_current_user: "user",
        deps.get_user_or_admin: "user or admin",
        deps.get_current_device: "device",
        deps.get_device_identity: "device",
        deps.require_any: "any token",
        ui.current_viewer: "dashboard session (cookie)",
    }


CSRF_FIELD = "csrf_token"  # a dashboard form's field: the session's CSRF token (server.dashboard.web.check_csrf)


UNKNOWN_AUTH = "a bearer token (of a kind these docs do not know: add its dependency to _auth_kinds)"


def _auth(route: Any, kinds: dict[Callable[..., Any], str]) -> str:
    """Who may call a route, from the auth dependencies it declares (however indirectly): ``none`` when it reads no
    bearer token at all."""
    found: list[str] = []
    stack = [route.dependant]
    while stack:
        dependant = stack.pop()
        kind = kinds.get(dependant.call)
        if kind and kind not in found:
            found.append(kind)
        stack.extend(dependant.dependencies)
    csrf = any(field.name == CSRF_FIELD for field in route.dependant.body_params)
    if found:
        return ", ".join(sorted(found)) + (" + CSRF form token" if csrf else "")
    if csrf:
        return "CSRF form token"
    return UNKNOWN_AUTH if _reads_bearer(route) else "none"


def retired(route: Any) -> bool:
    """A route kept only to answer 410 Gone (``server.routes.blobs``: downloads that moved to ``/v1/blobs``)."""
    return route.status_code == 410


def summary(route: Any, operation: dict[str, Any]) -> str:
    """The operation's summary: its own where a route set one, else the first line of the route's docstring, else
    FastAPI's (the function's name in title case)."""
    given = operation.get("summary") or ""
    default = route.name.replace("_", " ").title()
    paragraph = " ".join((route.endpoint.__doc__ or "").strip().split("\n\n")[0].split())
    sentence = paragraph.split(". ")[0].rstrip(".")
    if given and given != default:
        return given
    return sentence or given or route.name


def _reads_bearer(route: Any) -> bool:
    from fastapi.security.base import SecurityBase

    stack = [route.dependant]
    while stack:
        dependant = stack.pop()
        if isinstance(dependant.call, SecurityBase):
            return True
        stack.extend(dependant.dependencies)
    return False


def _ref_name(schema: dict[str, Any]) -> str:
    return schema["$ref"].rsplit("/", 1)[-1] if "$ref" in schema else ""


def _type(schema: dict[str, Any]) -> str:
    """A JSON schema as a short type: ``int``, ``JobCreate``, ``list[str]``, ``str | null``, ``"a" | "b"``."""
    if "$ref" in schema:
        return _ref_name(schema)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " | ".join(_type(option) for option in schema[key])
    if "enum" in schema:
        return " | ".join(f'"{value}"' if isinstance(value, str) else str(value) for value in schema["enum"])
    if "const" in schema:
        return f'"{schema["const"]}"' if isinstance(schema["const"], str) else str(schema["const"])
    kind = schema.get("type", "any")
    if kind == "array":
        return f"list[{_type(schema.get('items', {}))}]"
    if kind == "object" and "additionalProperties" in schema and isinstance(schema["additionalProperties"], dict):
        return f"dict[str, {_type(schema['additionalProperties'])}]"
    if kind == "string" and schema.get("format") == "binary":
        return "file"
    return {"integer": "int", "string": "str", "boolean": "bool", "number": "float", "object": "object"}.get(
        kind, str(kind)
    )


_BOUNDS = {
    "minimum": "≥ {}",
    "exclusiveMinimum": "> {}",
    "maximum": "≤ {}",
    "exclusiveMaximum": "< {}",
    "minLength": "length ≥ {}",
    "maxLength": "length ≤ {}",
    "minItems": "items ≥ {}",
    "maxItems": "items ≤ {}",
}


def _constraints(schema: dict[str, Any]) -> str:
    """A schema's bounds, as `` (≥ 1, ≤ 1000)`` (those of a nullable type's one other option included)."""
    found = [form.format(schema[key]) for key, form in _BOUNDS.items() if key in schema]
    for option in schema.get("anyOf", []):
        found += [form.format(option[key]) for key, form in _BOUNDS.items() if key in option]
    return f" ({', '.join(found)})" if found else ""


def _body(operation: dict[str, Any]) -> tuple[str, str, dict[str, Any] | None]:
    """(content type, schema name, inline schema) of an operation's request body."""
    content = operation.get("requestBody", {}).get("content", {})
    for content_type, media in content.items():
        schema = media.get("schema", {})
        options = [option for option in schema.get("anyOf", []) if option.get("type") != "null"]
        if len(options) == 1 and "$ref" in options[0]:  # ``Body | None``: the body may be left out
            schema = options[0]
        name = _ref_name(schema) or _type(schema)
        if "$ref" not in schema and "properties" in schema:
            return content_type, "", schema
        optional = " (optional)" if not operation["requestBody"].get("required") else ""
        return content_type, name + optional, None
    return "", "", None


def _fields_table(schema: dict[str, Any]) -> str:
    required = set(schema.get("required", []))
    rows = []
    for name, prop in schema.get("properties", {}).items():
        default = _code(_json(prop["default"])) if "default" in prop else ""
        rows.append(
            [
                _code(name),
                _code(_type(prop)) + _constraints(prop),
                "yes" if name in required else "",
                default,
                _text(prop.get("description", "")),
            ]
        )
    return _table(["field", "type", "required", "default", "meaning"], rows)


def _json(value: Any) -> str:
    return json.dumps(value)


def _body_schemas(schema: dict[str, Any], operations: list[dict[str, Any]]) -> list[str]:
    """The request body schemas' names (and the schemas they use, once each), in the order first used."""
    components = schema.get("components", {}).get("schemas", {})
    names: list[str] = []

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if ref and ref.rsplit("/", 1)[-1] not in names:
                name = ref.rsplit("/", 1)[-1]
                names.append(name)
                visit(components.get(name, {}))
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    for operation in operations:
        visit(operation.get("requestBody", {}))
    return names


def rest_markdown() -> str:
    """The REST reference: per tag, a table of endpoints (method, path, summary, auth, body, status codes), each
    endpoint's parameters, body and responses, then the request body schemas."""
    app = rest_app()
    schema = app.openapi()
    kinds = _auth_kinds()
    bearer = schema.get("components", {}).get("securitySchemes", {}).get("HTTPBearer", {})
    parts = [
        f"{_text(schema['info'].get('summary') or schema['info'].get('title'))} "
        f"(OpenAPI {schema['info'].get('version', '')}).",
        "Authentication is a bearer token (`Authorization: Bearer <token>`): "
        f"{_text(bearer.get('description', ''))}. The **auth** column says which kind a route takes; a missing or "
        "bad token is 401, a valid token of the wrong kind is 403. A running server serves the same schema at "
        "`/openapi.json` and an interactive page at `/docs`.",
    ]
    by_tag: dict[str, list[tuple[str, str, Any, dict[str, Any]]]] = {}
    gone = []
    for path, route in _api_routes(app):
        if retired(route):
            gone.extend(f"`{method} {path}`" for method in sorted(route.methods - {"HEAD"}))
            continue
        for method in sorted(route.methods - {"HEAD"}):
            operation = schema["paths"].get(path, {}).get(method.lower(), {})
            tag = (operation.get("tags") or list(route.tags) or ["other"])[0]
            by_tag.setdefault(str(tag), []).append((method, path, route, operation))

    for tag, endpoints in by_tag.items():
        parts.append(f"## {tag}")
        rows = []
        for method, path, route, operation in endpoints:
            content_type, body_name, inline = _body(operation)
            body = _code(body_name) if body_name else ("multipart" if inline is not None else "")
            rows.append(
                [
                    f"[`{method}`](#{_anchor(f'{method} {path}')})",
                    _code(path),
                    _text(summary(route, operation)),
                    _auth(route, kinds),
                    body,
                    ", ".join(sorted(operation.get("responses", {}))),
                ]
            )
        parts.append(_table(["method", "path", "summary", "auth", "request body", "status codes"], rows))
        for method, path, route, operation in endpoints:
            parts.append(f"### {method} {path}")
            parts.append(f"**{_text(summary(route, operation))}**. Auth: {_auth(route, kinds)}.")
            parts.append(_paragraphs(operation.get("description")))
            params = operation.get("parameters", [])
            if params:
                rows = [
                    [
                        _code(param["name"]),
                        param.get("in", ""),
                        _code(_type(param.get("schema", {}))) + _constraints(param.get("schema", {})),
                        "yes" if param.get("required") else "",
                        _code(_json(param["schema"]["default"])) if "default" in param.get("schema", {}) else "",
                        _text(param.get("description") or param.get("schema", {}).get("description")),
                    ]
                    for param in params
                ]
                parts.append(_table(["parameter", "in", "type", "required", "default", "meaning"], rows))
            content_type, body_name, inline = _body(operation)
            if body_name:
                target = body_name.split(" ")[0]
                link = f"[`{target}`](#{_anchor(target)})" if target in schema["components"]["schemas"] else target
                parts.append(f"Request body ({_code(content_type)}): {link}{body_name[len(target) :]}.")
            elif inline is not None:
                parts.append(f"Request body ({_code(content_type)}):")
                parts.append(_fields_table(inline))
            responses = operation.get("responses", {})
            if responses:
                rows = []
                for code, response in sorted(responses.items()):
                    names = [
                        _ref_name(media.get("schema", {})) or _type(media.get("schema", {}))
                        for media in response.get("content", {}).values()
                        if media.get("schema")
                    ]
                    rows.append([code, _text(response.get("description")), _code(", ".join(names))])
                parts.append(_table(["status", "meaning", "body"], rows))

    if gone:
        parts.append("## Retired routes")
        parts.append(
            f"These answer 410 Gone and name the route that replaced them: {', '.join(gone)}. Files are fetched "
            "by content from `GET /v1/blobs/{sha256}`."
        )
    operations = [op for endpoints in by_tag.values() for _, _, _, op in endpoints]
    parts.append("## Request body schemas")
    parts.append("The schemas of the request bodies above (and the schemas they use).")
    components = schema.get("components", {}).get("schemas", {})
    for name in _body_schemas(schema, operations):
        component = components.get(name, {})
        parts.append(f"### {name}")
        parts.append(_paragraphs(component.get("description")))
        if "properties" in component:
            parts.append(_fields_table(component))
        elif "enum" in component:
            parts.append(f"One of: {_code(_type(component))}.")
    return "\n\n".join(part for part in parts if part) + "\n"


# --- Settings -------------------------------------------------------------------------------------------------------


def _env_names(name: str, field: Any, prefix: str) -> list[str]:
    from pydantic import AliasChoices

    alias = field.validation_alias
    if isinstance(alias, AliasChoices):
        return [str(choice) for choice in alias.choices]
    if isinstance(alias, str):
        return [alias]
    return [f"{prefix}{name}".upper()]


def _annotation(annotation: Any) -> str:
    """A field's type as a reader writes it: ``int``, ``str | None``, ``"local" | "celery"``, ``Path``."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " | ".join(f'"{arg}"' if isinstance(arg, str) else str(arg) for arg in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_annotation(arg) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def _bounds(field: Any) -> str:
    signs = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}
    found = []
    for item in field.metadata:
        for key, sign in signs.items():
            value = getattr(item, key, None)
            if value is not None:
                found.append(f"{sign} {value}")
    return ", ".join(found)


def settings_fields() -> list[str]:
    """The names of the server's settings fields."""
    from server.settings import Settings

    return list(Settings.model_fields)


def settings_markdown() -> str:
    """The server settings: environment variable(s), type, default and meaning of each field."""
    from server.settings import Settings

    prefix = Settings.model_config.get("env_prefix", "")
    rows = []
    for name, field in Settings.model_fields.items():
        env = "<br>".join(_code(env_name) for env_name in _env_names(name, field, prefix))
        kind = _annotation(field.annotation)
        bounds = _bounds(field)
        default = field.default
        default = "unset" if default is None else _code(str(default).lower() if isinstance(default, bool) else default)
        if field.default_factory is not None:
            default = "computed"
        rows.append(
            [
                env,
                _code(name),
                _code(kind) + (f" ({_escape(bounds)})" if bounds else ""),
                default,
                _text(field.description),
            ]
        )
    parts = [
        _paragraphs(Settings.__doc__),
        "`mobizo server` and `mobizo worker` read them from the environment once per process; a value that does not "
        "parse, or breaks a bound, stops the process at start (the error names the field).",
        _table(["environment variable", "field", "type", "default", "meaning"], rows),
    ]
    return "\n\n".join(part for part in parts if part) + "\n"


# --- A job's defaults (shared.defaults) -----------------------------------------------------------------------------


def _number(value: float) -> str:
    """A default as people write it: 2e-2, 1e-6, 0.5, 4."""
    if value == 0 or 1e-3 < abs(value) < 1e3 and float(value).is_integer():
        return f"{value:g}"
    mantissa, exponent = f"{value:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}" if abs(value) < 1e-1 else f"{value:g}"


def defaults_markdown() -> str:
    """What a run takes for what it is not told (``shared.defaults``): per objective and method, then the rest."""
    from shared import defaults

    def schedule(name: str) -> str:
        return f"{name} to {_number(defaults.LR_FLOOR)}" if name != "constant" else name

    def row(objective: str, methods: tuple[str, ...], d: Any, adapter: bool = True, eps: bool = True) -> list[str]:
        rank = f"{d.rank} ({_number(defaults.alpha_for(d.rank))})" if adapter else "(no adapter)"
        cells = [_number(d.lr), schedule(d.lr_schedule), _number(d.eps) if eps else "(unused)", str(d.steps), rank]
        return [objective, ", ".join(_code(m) for m in methods), *cells]

    zo = defaults.ZO_LORA_METHODS
    rows = [
        row("classification", zo, defaults.for_method(zo[0], objective="classification")),
        row("lm", zo, defaults.for_method(zo[0], objective="lm")),
        row("any", ("fo-lora",), defaults.for_method("fo-lora"), eps=False),
        row("any", ("mezo",), defaults.for_method("mezo"), adapter=False),
    ]
    header = ["objective", "method", "lr", "schedule", "eps", "steps", "rank (alpha)"]
    quantized = ", ".join(f"{_code(q)}: eps {_number(e)}" for q, e in defaults.QUANTIZED_EPS.items())
    other = [
        ["q (queries per step)", f"{defaults.Q} for {_code(defaults.METHOD)}, 1 for the other methods"],
        ["batch size", f"{defaults.BATCH_SIZE}, in length buckets of {defaults.BUCKET} batches"],
        ["targets", ", ".join(_code(t) for t in defaults.TARGETS)],
        ["seq_len (a program's rows)", str(defaults.SEQ_LEN)],
        ["seed, A seed", f"{defaults.SEED}, {defaults.A_SEED}"],
        ["backend, parallel", f"{_code(defaults.PROGRAM_BACKEND)}, {_code(defaults.PARALLEL)}"],
        [
            "quantize (group size)",
            f"{_code(defaults.QUANTIZE)} ({defaults.GROUP_SIZE}); {quantized} for {', '.join(zo)}",
        ],
        ["warm-up steps, decay floor", f"{defaults.WARMUP_STEPS}, {_number(defaults.LR_FLOOR)}"],
        ["held-out examples", str(defaults.EVAL_EXAMPLES)],
    ]
    alpha = f"Without `--alpha`, alpha is {_number(defaults.SCALING)} × rank."
    return "\n\n".join([_table(header, rows), alpha, _table(["setting", "default"], other)]) + "\n"


# --- The hook -------------------------------------------------------------------------------------------------------

GENERATORS: dict[str, Callable[[], str]] = {
    "reference/cli.md": cli_markdown,
    "reference/rest.md": rest_markdown,
    "reference/settings.md": settings_markdown,
    "guide/jobs.md": defaults_markdown,
}


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace a reference stub's marker with its generated page."""
    src = page.file.src_uri
    if src not in GENERATORS:
        return markdown
    marker = MARKERS[src]
    if marker not in markdown:
        from mkdocs.exceptions import PluginError

        raise PluginError(f"docs/{src} lost its marker {marker!r}: the generated reference has nowhere to go")
    return markdown.replace(marker, GENERATORS[src]())
