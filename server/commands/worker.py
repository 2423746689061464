"""``mobizo worker``: a Celery worker for ``MOBIZO_QUEUE=celery`` (``server.celery_queue``)."""

from __future__ import annotations

import argparse

from shared.errors import ExitCode

HELP = (
    "run a Celery worker that compiles programs and verifies results for servers started with MOBIZO_QUEUE=celery "
    "(MOBIZO_BROKER_URL, DATABASE_URL, MOBIZO_DATA_DIR from the environment, as for the server)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--queues",
        default="compile,verify",
        help="comma-separated queues to take tasks from: compile, verify (default both); a worker on verify alone "
        "never makes a replay wait behind an export",
    )
    parser.add_argument("--concurrency", type=int, default=1, help="tasks run at once, one process each (default 1)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def run(args: argparse.Namespace) -> ExitCode:
    import logging
    import os
    import secrets

    from server.celery_queue import QUEUES, make_celery
    from server.settings import get_settings
    from shared.errors import MobizoError, UsageError

    queues = [q.strip() for q in args.queues.split(",") if q.strip()]
    unknown = [q for q in queues if q not in QUEUES]
    if not queues or unknown:
        raise UsageError("queues", f"must name {' and/or '.join(QUEUES)} (got {args.queues!r})")
    if args.concurrency < 1:
        raise UsageError("concurrency", f"must be at least 1 (got {args.concurrency})")
    settings = get_settings()
    if not settings.broker_url:
        raise MobizoError("MOBIZO_BROKER_URL is not set: name the Celery broker, e.g. redis://127.0.0.1:6379/0")
    # our and Celery's messages at --log-level; libraries (the exporter logs every tensor at INFO) at warning
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for name in ("server", "celery"):
        logging.getLogger(name).setLevel(args.log_level.upper())
    app = make_celery(settings)
    app.worker_main(
        [
            "worker",
            f"--queues={','.join(queues)}",
            f"--concurrency={args.concurrency}",
            f"--loglevel={args.log_level.upper()}",
            # unique per process, so several workers share a machine, or a host's network (containers there share
            # its host name, and each worker is its container's pid 1)
            f"--hostname=mobizo-{os.getpid()}-{secrets.token_hex(3)}@%h",
        ]
    )
    return ExitCode.OK
