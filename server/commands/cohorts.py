"""``mobizo cohorts create|list|join|leave``: cohorts that learn one shared adapter across their members' devices.

The admin creates a cohort (``create``, admin token); each user opts in or out with their own key (``join``,
``leave``); ``list`` shows every cohort and, for a user, whether they are in it. Only opted-in users' devices ever
receive a cohort's round work. Federated jobs are submitted with ``mobizo jobs submit --cohort ID``.
"""

from __future__ import annotations

import argparse

from server.commands import add_connection_args, client_from_args, print_json, print_table
from shared.errors import ExitCode

HELP = "cohorts for federated rounds: create (admin), list, join and leave (user)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = sub.add_parser("create", help="(admin) a cohort for a model and a task (prints it as JSON)")
    create.add_argument("name", help="the cohort's name (letters, digits, . _ -)")
    create.add_argument("--model", required=True, help="a registered model's name")
    create.add_argument("--task", required=True, help="a built-in task (sst2, rte, ...)")
    add_connection_args(create, admin=True)
    listing = sub.add_parser("list", help="every cohort; with a user's key, whether you are a member")
    listing.add_argument("--json", action="store_true", help="print the full objects as JSON")
    add_connection_args(listing)
    for action, text in (
        ("join", "opt in: your devices may receive this cohort's round work"),
        ("leave", "opt out: no further round work, and the cohort's adapters are no longer yours to see"),
    ):
        p = sub.add_parser(action, help=text)
        p.add_argument("cohort_id", type=int)
        add_connection_args(p)


def run(args: argparse.Namespace) -> ExitCode:
    client = client_from_args(args)
    if args.action == "create":
        print_json(client.post("/v1/cohorts", {"name": args.name, "model": args.model, "task": args.task}))
    elif args.action == "list":
        cohorts = client.get("/v1/cohorts")
        if args.json:
            print_json(cohorts)
        else:
            print_table(cohorts["data"], ["id", "name", "model", "task", "members", "member"])
    else:
        print_json(client.post(f"/v1/cohorts/{args.cohort_id}/{args.action}"))
    return ExitCode.OK
