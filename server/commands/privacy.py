"""``mobizo privacy show|budget``: your privacy ledger (the budget your private jobs spend from, what they spent, each
job's epsilon, delta, noise and sampling) and setting its budget (``server.privacy``); with ``--cohort ID``, a
cohort's ledger (its private federated jobs), whose budget the admin sets."""

from __future__ import annotations

import argparse

from server.commands import add_connection_args, client_from_args, print_json, print_table
from shared.errors import ExitCode

HELP = "your privacy ledger: the budget of your private jobs and what they spent"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = sub.add_parser("show", help="the budget, epsilon spent and remaining, and your private jobs")
    show.add_argument("--json", action="store_true", help="print the ledger as JSON")
    show.add_argument("--cohort", type=int, metavar="ID", help="a cohort's ledger instead of yours")
    add_connection_args(show)
    budget = sub.add_parser("budget", help="set the budget (not below what your private jobs spent)")
    budget.add_argument("--epsilon", type=float, required=True, help="epsilon over all your private jobs")
    budget.add_argument("--delta", type=float, help="at this delta (default 1e-5)")
    budget.add_argument(
        "--cohort", type=int, metavar="ID", help="a cohort's budget instead (its private federated jobs; admin token)"
    )
    add_connection_args(budget)


def run(args: argparse.Namespace) -> ExitCode:
    client = client_from_args(args)
    path = "/v1/privacy" if args.cohort is None else f"/v1/cohorts/{args.cohort}/privacy"
    if args.action == "budget":
        body = {"epsilon": args.epsilon} | ({"delta": args.delta} if args.delta is not None else {})
        ledger = client.put(path, body)
    else:
        ledger = client.get(path)
    if getattr(args, "json", False):
        print_json(ledger)
        return ExitCode.OK
    budget = ledger["budget"]
    print(
        f"budget: epsilon {budget['epsilon']:g} at delta {budget['delta']:g}; spent {ledger['spent']:.3g}, "
        f"remaining {ledger['remaining']:.3g}"
    )
    rows = [
        {"job_id": e["job_id"], "round": e.get("round"), "status": e["status"], "counts": e["spends"]}
        | {"steps": e["steps"]}
        | {k: e["privacy"][k] for k in ("epsilon", "delta", "noise_multiplier", "clip", "min_examples")}
        | {"batch_size": e["batch_size"]}
        for e in ledger["jobs"]
    ]
    if rows:
        columns = ["job_id", "round", "status", "counts", "epsilon", "delta", "noise_multiplier", "clip", "steps"]
        print_table(rows, [*columns, "batch_size", "min_examples"])
    return ExitCode.OK
