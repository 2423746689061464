"""``mobizo server``: run the REST server (settings from the environment, see ``server.settings``)."""

from __future__ import annotations

import argparse

from shared.errors import ExitCode

HELP = "run the REST server (DATABASE_URL, MOBIZO_DATA_DIR, MOBIZO_ADMIN_TOKEN, ... from the environment)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="API processes sharing the port (default 1); more than 1 needs MOBIZO_QUEUE=celery, since the "
        "in-process compile queue belongs to one process",
    )
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def run(args: argparse.Namespace) -> ExitCode:
    import logging

    import uvicorn

    from server.app import create_app
    from server.http_protocol import HeaderTimeoutProtocol
    from server.settings import get_settings
    from shared.errors import UsageError

    if not 0 < args.port < 65536:
        raise UsageError("port", f"must be in 1..65535 (got {args.port})")
    settings = get_settings()
    if args.workers < 1:
        raise UsageError("workers", f"must be at least 1 (got {args.workers})")
    if args.workers > 1 and settings.queue != "celery":
        raise UsageError("workers", "more than 1 needs MOBIZO_QUEUE=celery (and MOBIZO_BROKER_URL)")
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if settings.admin_token is None:
        logging.warning("MOBIZO_ADMIN_TOKEN is not set: admin endpoints (users, models) will refuse every request")
    logging.info("dashboard at http://%s:%d/ui (sign in with an API key); metrics at /metrics", args.host, args.port)
    # X-Forwarded-For names the client only from MOBIZO_TRUSTED_PROXIES (uvicorn's own default trusts loopback)
    proxies = {"proxy_headers": bool(settings.proxies), "forwarded_allow_ips": settings.proxies or None}
    if args.workers == 1:
        uvicorn.run(
            create_app(settings),
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            http=HeaderTimeoutProtocol,
            **proxies,
        )
    else:  # each process builds its own app from the same environment, and logs as this one does
        from uvicorn.config import LOGGING_CONFIG

        root = {"handlers": ["default"], "level": args.log_level.upper()}
        uvicorn.run(
            "server.app:create_app",
            factory=True,
            http=HeaderTimeoutProtocol,
            workers=args.workers,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            log_config={**LOGGING_CONFIG, "root": root},
            **proxies,
        )
    return ExitCode.OK
