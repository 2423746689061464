"""``mobizo models register|list``: the server's registry of base models (the ``import`` subcommand is the core's)."""

from __future__ import annotations

import argparse
from pathlib import Path

from server.commands import add_connection_args, client_from_args, print_json, print_table
from shared.errors import ExitCode, UsageError


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    register = sub.add_parser("register", help="(admin) register a Hugging Face model directory on the server")
    register.add_argument("name", help="the name jobs will use (letters, digits, . _ -)")
    register.add_argument(
        "--path", required=True, type=Path, help="the model directory, as the server sees it (an absolute path)"
    )
    add_connection_args(register, admin=True)
    register.set_defaults(_run=run_register, _parser=register)
    listing = sub.add_parser("list", help="the registered models")
    listing.add_argument("--json", action="store_true", help="print the full objects as JSON")
    add_connection_args(listing)
    listing.set_defaults(_run=run_list, _parser=listing)


def run_register(args: argparse.Namespace) -> ExitCode:
    if not args.path.expanduser().is_absolute():  # the server would read it from its own working directory
        raise UsageError("path", "must be an absolute path: the model directory as the server sees it")
    print_json(client_from_args(args).post("/v1/models", {"name": args.name, "path": str(args.path)}))
    return ExitCode.OK


def run_list(args: argparse.Namespace) -> ExitCode:
    models = client_from_args(args).get("/v1/models")
    if args.json:
        print_json(models)
    else:
        print_table(models["data"], ["id", "name", "architecture", "sha256"])
    return ExitCode.OK
