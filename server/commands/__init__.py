"""Command-line commands of the server package: ``mobizo server``, and the REST client commands.

The client commands share their connection options: ``--server`` (env ``MOBIZO_SERVER``, default
``http://127.0.0.1:8000``) and ``--token`` (env ``MOBIZO_TOKEN``: a user's API key; ``MOBIZO_ADMIN_TOKEN`` for
admin commands) or ``--token-file FILE`` (the token on its first line): a token given as ``--token`` is visible
to every local user in the process list, so the environment or a 0600 file is the way to pass it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

DEFAULT_SERVER = "http://127.0.0.1:8000"


def add_connection_args(parser: argparse.ArgumentParser, admin: bool = False) -> None:
    env = "MOBIZO_ADMIN_TOKEN" if admin else "MOBIZO_TOKEN"
    parser.add_argument(
        "--server",
        default=os.environ.get("MOBIZO_SERVER", DEFAULT_SERVER),
        help=f"server URL (env MOBIZO_SERVER, default {DEFAULT_SERVER})",
    )
    what = "admin token" if admin else "your API key"
    token = parser.add_mutually_exclusive_group()
    token.add_argument(
        "--token", default=os.environ.get(env), help=f"{what} (env {env}; visible to others in the process list)"
    )
    token.add_argument("--token-file", type=Path, help=f"a file whose first line is the {what}")


def _token(args: argparse.Namespace) -> str | None:
    from shared.errors import UsageError

    if args.token_file is None:
        return args.token
    try:
        lines = args.token_file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError("token_file", f"cannot read {args.token_file} ({exc})") from None
    return lines[0].strip() if lines else None


def client_from_args(args: argparse.Namespace):
    from server.client import ServerClient
    from shared.errors import UsageError

    token = _token(args)
    if not token:
        raise UsageError("token", "required (or --token-file, or the environment variable shown in --help)")
    return ServerClient(args.server, token)


def print_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2)
    sys.stdout.write("\n")


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    """Plain aligned columns for people; ``--json`` gives the full objects for scripts."""
    cells = [[str(row.get(c, "")) if row.get(c) is not None else "-" for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip())
    for r in cells:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
