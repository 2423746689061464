"""``mobizo devices list|revoke``: your enrolled devices; revoke a lost or sold one (its token is refused from the
next request on, and the work it held goes back to the queue)."""

from __future__ import annotations

import argparse

from server.commands import add_connection_args, client_from_args, print_json, print_table
from shared.errors import ExitCode

HELP = "list your enrolled devices and revoke them"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = sub.add_parser("list", help="your devices, oldest first")
    listing.add_argument("--json", action="store_true", help="print the full objects as JSON")
    add_connection_args(listing)
    revoke = sub.add_parser(
        "revoke", help="revoke a device: its token stops working at once (your API key, or the admin token)"
    )
    revoke.add_argument("device_id", type=int)
    add_connection_args(revoke)


def cpu_text(cpu: dict | None) -> str | None:
    """A reported CPU on one line: its architecture, then its features."""
    return None if cpu is None else " ".join([cpu["arch"], *cpu["features"]])


def run(args: argparse.Namespace) -> ExitCode:
    client = client_from_args(args)
    if args.action == "list":
        devices = client.get("/v1/devices")
        if args.json:
            print_json(devices)
        else:
            columns = ["id", "name", "platform", "backend", "cpu", "memory_mb", "last_seen_at", "revoked_at"]
            print_table([{**d, "cpu": cpu_text(d.get("cpu"))} for d in devices["data"]], columns)
        return ExitCode.OK
    print_json(client.post(f"/v1/devices/{args.device_id}/revoke"))
    return ExitCode.OK
