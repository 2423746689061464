"""``mobizo enroll-code``: a one-time, expiring code for ``mobizo agent enroll --code`` on a new device."""

from __future__ import annotations

import argparse

from server.commands import add_connection_args, client_from_args, print_json
from shared.errors import ExitCode

HELP = "create a one-time code that enrolls one device for you"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ttl", type=int, default=900, help="seconds until the code expires (default 900)")
    parser.add_argument("--json", action="store_true", help="print {code, expires_at} as JSON")
    add_connection_args(parser)


def run(args: argparse.Namespace) -> ExitCode:
    from shared.errors import UsageError

    if not 60 <= args.ttl <= 7 * 24 * 3600:
        raise UsageError("ttl", f"must be between 60 s and 7 days (got {args.ttl})")
    code = client_from_args(args).post("/v1/enrollment-codes", {"ttl_s": args.ttl})
    if args.json:
        print_json(code)
    else:
        print(f"{code['code']}  (expires {code['expires_at']})")
    return ExitCode.OK
