"""``mobizo agent enroll`` and ``mobizo agent run``: the device side of mobizo.

``enroll`` trades a one-time code for a device token, kept in the agent config (``device_agent.config``: mode 0600;
``--config``, else ``$MOBIZO_AGENT_CONFIG``, else ``~/.config/mobizo/agent.json``). ``run`` is the daemon: lease a
job, download its program, train on the local data in ``--data-dir`` with the chosen backend, upload B, the log
and metrics, repeat; SIGTERM or Ctrl-C finishes the current step, checkpoints and exits 0.

Backends (``--backend``, default: the one enrolled): ``executorch`` runs the program in this process;
``torch`` runs the same step eagerly in PyTorch on ``--model-dir`` (the job's base model as a Hugging Face
directory on this device; checked against the server's registered models and the program before training);
``adb`` drives an Android phone with ``adb``, pushing the native runner ``--runner``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from shared.backends import DEVICE_BACKENDS
from shared.errors import ExitCode

HELP = "the device agent: enroll this device, then run it (lease a job, train locally, upload only LoRA-B)"

HELP = "the device agent: enroll this device, then run it (lease a job, train locally, upload only LoRA-B)"


def _runner_default() -> Path:
    """The runner built for a phone when there is one, else the one built for this machine (adb stand-in)."""
    build = Path(__file__).resolve().parents[1] / "runner" / "build"
    android = build / "android-arm64-v8a" / "mobizo_runner"
    return android if android.is_file() else build / "mobizo_runner"


def _add_backend_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-dir", type=Path, help="torch backend: the base model (Hugging Face directory)")
    parser.add_argument("--device", help="torch backend: cpu or cuda (default: cuda when available)")
    parser.add_argument(
        "--runner",
        type=Path,
        default=None,
        help=f"adb backend: the native runner to push (default: {_runner_default()})",
    )
    parser.add_argument("--serial", help="adb backend: the phone's serial (default: the only one attached)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    enroll = sub.add_parser("enroll", help="register this device with a one-time code; stores its token")
    enroll.add_argument("--server", required=True, help="the server's URL, e.g. http://127.0.0.1:8000")
    enroll.add_argument("--code", required=True, help="a one-time enrollment code (mobizo enroll-code)")
    enroll.add_argument("--name", help="this device's name (default: the host name)")
    enroll.add_argument("--backend", choices=DEVICE_BACKENDS, default="executorch", help="how this device trains")
    enroll.add_argument("--config", type=Path, help="where to keep the token (default: ~/.config/mobizo/agent.json)")
    enroll.add_argument("--serial", help="adb backend: the phone's serial (default: the only one attached)")
    run = sub.add_parser("run", help="the daemon: lease → download → train → upload, until stopped")
    run.add_argument("--once", action="store_true", help="exit after one job has ended (waits for one)")
    run.add_argument(
        "--data-dir",
        type=Path,
        help="local training data: <task>/train.jsonl or <task>.jsonl (default: the project's shared data folder)",
    )
    run.add_argument("--backend", choices=DEVICE_BACKENDS, help="override the enrolled backend for this run")
    run.add_argument("--config", type=Path, help="the agent config (default: ~/.config/mobizo/agent.json)")
    run.add_argument(
        "--work-dir",
        type=Path,
        help="downloads, checkpoints and results in progress (default: ~/.cache/mobizo/agent-<device id>)",
    )
    run.add_argument("--checkpoint-every", type=int, default=50, metavar="K", help="checkpoint every K steps (50)")
    run.add_argument("--heartbeat-s", type=float, default=5.0, help="seconds between heartbeats at most (5)")
    run.add_argument("--poll-s", type=float, default=5.0, help="seconds between lease requests when idle (5)")
    run.add_argument(
        "--retry-cap-s",
        type=float,
        default=30.0,
        help="longest wait between retries while the server is unreachable (30)",
    )
    _add_backend_options(run)


def run(args: argparse.Namespace) -> ExitCode:
    return _enroll(args) if args.action == "enroll" else _run(args)


def _backend(args: argparse.Namespace, name: str, registered):
    from device_agent.backends import make_backend

    return make_backend(
        name,
        model_dir=args.model_dir,
        registered=registered,
        device=args.device,
        runner=args.runner or _runner_default(),
        serial=args.serial,
    )


def _memory_mb(args: argparse.Namespace) -> int | None:
    """Free memory where this device trains: the phone's for adb, this machine's otherwise."""
    if args.backend == "adb":
        from device_agent.backends.adb import Phone

        return Phone(args.serial).free_memory_mb()
    from device_agent.resources import free_memory_mb

    return free_memory_mb()


def _enroll(args: argparse.Namespace) -> int:
    import platform
    import socket

    import httpx

    from device_agent import api
    from device_agent.config import AgentConfig, config_path, save_config
    from shared.errors import MobizoError
    from shared.schemas import DeviceCreate

    system = "android (adb)" if args.backend == "adb" else platform.platform(terse=True)
    body = DeviceCreate(
        code=args.code,
        name=args.name or socket.gethostname(),
        platform=system[:128],
        backend=args.backend,
        memory_mb=_memory_mb(args),
    )
    with api.client(args.server) as http:
        try:
            enrolled = api.enroll(http, body)
        except httpx.HTTPError as error:
            raise MobizoError(f"enrollment failed: {error}") from None
    cfg = AgentConfig(args.server.rstrip("/"), str(enrolled.device_id), enrolled.token, args.backend, body.name)
    path = save_config(cfg, config_path(args.config))
    print(f"enrolled device {enrolled.device_id} ({body.name}, {args.backend}); token saved in {path}")
    return ExitCode.OK


def _data_dir(args: argparse.Namespace) -> Path:
    """The checked ``run`` options → the data folder."""
    from shared.errors import UsageError
    from shared.tasks import shared_data_dir

    for flag, value in (
        ("--checkpoint-every", args.checkpoint_every),
        ("--heartbeat-s", args.heartbeat_s),
        ("--poll-s", args.poll_s),
        ("--retry-cap-s", args.retry_cap_s),
    ):
        if value <= 0:
            raise UsageError(flag, f"must be positive, got {value}")
    data_dir = args.data_dir or shared_data_dir()
    if not data_dir.is_dir():
        raise UsageError("--data-dir", f"{data_dir} is not a folder")
    return data_dir


def _run(args: argparse.Namespace) -> int:
    import threading

    from device_agent import api
    from device_agent.config import config_path, load_config
    from device_agent.daemon import RunOptions, default_work_dir, serve, stop_on_signals
    from device_agent.events import Reporter
    from device_agent.job import AgentContext, retry_policy
    from shared.retry import Backoff, call_with_retry

    data_dir, cfg = _data_dir(args), load_config(config_path(args.config))
    stop, backoff, reporter = threading.Event(), Backoff(cap=args.retry_cap_s), Reporter()
    stop_on_signals(stop)
    with api.client(cfg.server_url, cfg.token) as http:
        device_api = api.DeviceAPI(http)

        def registered() -> set[str]:  # the server's models, for the torch backend's check
            return call_with_retry(retry_policy(stop, backoff, reporter), device_api.registered_models)

        ctx = AgentContext(
            api=device_api,
            backend=_backend(args, args.backend or cfg.backend, registered),
            work_dir=args.work_dir or default_work_dir(cfg.device_id),
            data_dir=data_dir,
            reporter=reporter,
            stop=stop,
            checkpoint_every=args.checkpoint_every,
            heartbeat_s=args.heartbeat_s,
            backoff=backoff,
        )
        ctx.reporter.event("started", device_id=cfg.device_id, backend=ctx.backend.name, server=cfg.server_url)
        return serve(ctx, RunOptions(once=args.once, poll_s=args.poll_s))
