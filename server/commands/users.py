"""``mobizo users create NAME``: create a user (admin) and print its API key, which is shown only once."""

from __future__ import annotations

import argparse

from server.commands import add_connection_args, client_from_args, print_json
from shared.errors import ExitCode

HELP = "create users (admin): prints the new user's API key once"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = sub.add_parser("create", help="create a user and print {id, name, api_key}")
    create.add_argument("name", help="user name (letters, digits, . _ -)")
    add_connection_args(create, admin=True)


def run(args: argparse.Namespace) -> ExitCode:
    client = client_from_args(args)
    print_json(client.post("/v1/users", {"name": args.name}))
    return ExitCode.OK
