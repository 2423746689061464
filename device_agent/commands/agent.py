"""``mobizo agent enroll`` and ``mobizo agent run``: the device side of mobizo.

``enroll`` trades a one-time code for a device token, kept in the agent config (``device_agent.config``: mode 0600;
``--config``, else ``$MOBIZO_AGENT_CONFIG``, else ``~/.config/mobizo/agent.json``). ``run`` is the daemon: lease a
job, download its program, train on the local data in ``--data-dir`` with the chosen backend, upload B, the log
and metrics, repeat; SIGTERM or Ctrl-C finishes the current step, checkpoints and exits 0.

Backends (``--backend``, default: the one enrolled): ``executorch`` runs the program in this process;
``torch`` runs the same step eagerly in PyTorch on ``--model-dir`` (the job's base model as a Hugging Face
directory on this device; checked against the server's registered models and the program before training);
``adb`` drives an Android phone with ``adb``, pushing the native runner ``--runner``; ``native`` runs the native
runner ``--runner`` on this machine. The memory and CPU the device reports and the training policy's readings are
the backend's host's (``device_agent.backends.transports``): the phone's for adb, this machine's otherwise.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from device_agent.runner_path import runner_default
from shared import defaults
from shared.backends import DEVICE_BACKENDS, RUNNER_BACKENDS
from shared.errors import ExitCode

HELP = "the device agent: enroll this device, then run it (lease a job, train locally, upload only LoRA-B)"


def _add_backend_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-dir", type=Path, help="torch backend: the base model (Hugging Face directory)")
    parser.add_argument("--device", help="torch backend: cpu or cuda (default: cuda when available)")
    parser.add_argument(
        "--runner",
        type=Path,
        default=None,
        help="adb and native backends: the native runner, a binary or a bundle folder (default: adb "
        f"{runner_default('adb')}; native {runner_default('native')})",
    )
    parser.add_argument("--serial", help="adb backend: the phone's serial (default: the only one attached)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    enroll = sub.add_parser("enroll", help="register this device with a one-time code; stores its token")
    enroll.add_argument("--server", required=True, help="the server's URL, e.g. http://127.0.0.1:8000")
    enroll.add_argument(
        "--code",
        help="the one-time enrollment code (mobizo enroll-code); without it, $MOBIZO_ENROLLMENT_CODE or a line of "
        "standard input (asked for on a terminal), which the process list does not show",
    )
    enroll.add_argument("--name", help="this device's name (default: the host name)")
    enroll.add_argument("--backend", choices=DEVICE_BACKENDS, default="executorch", help="how this device trains")
    enroll.add_argument("--config", type=Path, help="where to keep the token (default: ~/.config/mobizo/agent.json)")
    enroll.add_argument("--serial", help="adb backend: the phone's serial (default: the only one attached)")
    run = sub.add_parser("run", help="the daemon: lease → download → train → upload, until stopped")
    run.add_argument("--once", action="store_true", help="exit after one job has ended (waits for one)")
    run.add_argument(
        "--data-dir",
        type=Path,
        help="local training data: <task>/train.jsonl or <task>.jsonl "
        "(default: the shipped samples in data/, or $MOBIZO_TASK_DATA_DIR)",
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
    run.add_argument(
        "--poll-s",
        type=float,
        default=5.0,
        help="seconds between lease requests when idle (5; longer when the server's Retry-After asks)",
    )
    run.add_argument(
        "--retry-cap-s",
        type=float,
        default=30.0,
        help="longest wait between retries while the server is unreachable (30)",
    )
    _add_backend_options(run)
    policy = run.add_argument_group(
        'training policy (also the config\'s "policy" object): train only while it holds; pause and resume when not'
    )
    policy.add_argument("--min-battery", type=float, help="lowest battery level in %% (default 20)")
    policy.add_argument("--max-temp-c", type=float, help="highest temperature in °C (default 45)")
    policy.add_argument("--allow-discharging", action="store_true", help="train on battery power too")
    policy.add_argument("--allow-screen-on", action="store_true", help="phones: train with the screen on too")
    policy.add_argument("--sysfs-root", type=Path, help="Linux/Jetson: read /sys/class/... under this root (/)")
    policy.add_argument("--policy-check-s", type=float, help="re-read the readings at most this often (5)")
    policy.add_argument("--pause-limit-s", type=float, help="keep a paused job's lease this long, then release (1800)")
    policy.add_argument("--no-policy", action="store_true", help="train whenever there is work")
    _add_inference_actions(sub)


def _add_inference_options(parser: argparse.ArgumentParser) -> None:
    """What both on-device inference actions share: which adapter (or base), where the config and cache are."""
    parser.add_argument("--adapter-id", type=int, help="one of your adapters (mobizo adapters list); none: the base")
    parser.add_argument("--model", help="without --adapter-id: the registered model whose base to run")
    parser.add_argument("--max-context", type=int, default=defaults.MAX_CONTEXT, help="the program's KV cache (512)")
    parser.add_argument("--config", type=Path, help="the agent config (default: ~/.config/mobizo/agent.json)")
    parser.add_argument("--work-dir", type=Path, help="the download cache (default: ~/.cache/mobizo/agent-<id>)")


def _add_inference_actions(sub) -> None:
    from shared.commands.eval import add_arguments as add_eval_arguments
    from shared.commands.generate import add_sampling_arguments

    generate = sub.add_parser(
        "generate", help="generate text on this device with one of your adapters (the ExecuTorch inference program)"
    )
    _add_inference_options(generate)
    generate.add_argument(
        "--backend",
        choices=("executorch", *RUNNER_BACKENDS),
        default="executorch",
        help="executorch: in this process (default); adb: on the phone, native: on this machine, in the native "
        "runner's generate mode (greedy)",
    )
    generate.add_argument(
        "--runner",
        type=Path,
        help=f"adb and native: the native runner (default: adb {runner_default('adb')}; "
        f"native {runner_default('native')})",
    )
    generate.add_argument("--serial", help="adb: the phone's serial (default: the only one attached)")
    add_sampling_arguments(generate)
    evaluate = sub.add_parser(
        "eval", help="accuracy and loss of one of your adapters on local data, through the on-device program"
    )
    _add_inference_options(evaluate)
    add_eval_arguments(evaluate, model=False)


def run(args: argparse.Namespace) -> ExitCode:
    if args.action in ("generate", "eval"):
        from device_agent.commands.local_inference import run_local

        return run_local(args)
    return _enroll(args) if args.action == "enroll" else _run(args)


def _backend(args: argparse.Namespace, name: str, registered, work_dir: Path):
    from device_agent.backends.make import make_backend

    return make_backend(
        name,
        model_dir=args.model_dir,
        registered=registered,
        device=args.device,
        runner=args.runner or runner_default(name),
        serial=args.serial,
        work_dir=work_dir,
    )


def _enrollment_code(given: str | None) -> str:
    """``--code``, else ``$MOBIZO_ENROLLMENT_CODE``, else a line of standard input (a prompt without echo on a
    terminal): a code on the command line shows in the process list while it is being used."""
    import getpass
    import os
    import sys

    from shared.errors import UsageError

    code = given or os.environ.get("MOBIZO_ENROLLMENT_CODE")
    if not code:
        code = getpass.getpass("enrollment code: ") if sys.stdin.isatty() else sys.stdin.readline()
    code = code.strip()
    if not code:
        raise UsageError("code", "no enrollment code: give --code, MOBIZO_ENROLLMENT_CODE or a line on standard input")
    return code


def _enroll(args: argparse.Namespace) -> int:
    import socket

    import httpx

    from device_agent import api
    from device_agent.backends.make import make_host
    from device_agent.config import AgentConfig, config_path, save_config
    from shared.errors import MobizoError
    from shared.schemas import DeviceCreate

    host = make_host(args.backend, args.serial)  # where this device's steps will run
    body = DeviceCreate(
        code=_enrollment_code(args.code),
        name=args.name or socket.gethostname(),
        platform=host.platform()[:128],
        backend=args.backend,
        memory_mb=host.free_memory_mb(),
        cpu=host.cpu(),
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


def _policy(args: argparse.Namespace, cfg, host):
    """(the device's Eligibility, the pause limit) from the config's ``policy`` and the options; the readings are
    the backend's host's (``host.readings``: sysfs under the policy's root here, dumpsys on a phone)."""
    from device_agent.eligibility import DEFAULT_CHECK_S, Eligibility, Policy, always
    from shared.errors import UsageError

    options = dict(cfg.policy or {})
    for key, value in (
        ("min_battery_pct", args.min_battery),
        ("max_temp_c", args.max_temp_c),
        ("sysfs_root", args.sysfs_root),
        ("check_s", args.policy_check_s),
        ("pause_limit_s", args.pause_limit_s),
    ):
        if value is not None:
            options[key] = value
    if args.allow_discharging:
        options["require_charging"] = False
    if args.allow_screen_on:
        options["require_screen_off"] = False
    pause_limit_s = float(options.pop("pause_limit_s", 1800.0))
    check_s = float(options.pop("check_s", DEFAULT_CHECK_S))
    root = Path(options.pop("sysfs_root", "/"))
    if args.no_policy:
        return always(), pause_limit_s
    try:
        policy = Policy(**options)
    except TypeError as exc:
        raise UsageError("config", f"policy: {exc}") from None
    return Eligibility(policy, lambda: host.readings(root), check_s), pause_limit_s


def _data_dir(args: argparse.Namespace) -> Path:
    """The checked ``run`` options → the data folder."""
    from shared.errors import UsageError
    from shared.tasks import task_data_dir

    for field in ("checkpoint_every", "heartbeat_s", "poll_s", "retry_cap_s"):
        value = getattr(args, field)
        if value <= 0:
            raise UsageError(field, f"must be positive, got {value}")
    data_dir = args.data_dir or task_data_dir()
    if not data_dir.is_dir():
        raise UsageError("data_dir", f"{data_dir} is not a folder")
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

        work_dir = args.work_dir or default_work_dir(cfg.device_id)
        backend = _backend(args, args.backend or cfg.backend, registered, work_dir)
        eligibility, pause_limit_s = _policy(args, cfg, backend.host)
        ctx = AgentContext(
            api=device_api,
            backend=backend,
            work_dir=work_dir,
            data_dir=data_dir,
            reporter=reporter,
            stop=stop,
            checkpoint_every=args.checkpoint_every,
            heartbeat_s=args.heartbeat_s,
            backoff=backoff,
            eligibility=eligibility,
            pause_limit_s=pause_limit_s,
        )
        ctx.reporter.event("started", device_id=cfg.device_id, backend=ctx.backend.name, server=cfg.server_url)
        return serve(ctx, RunOptions(once=args.once, poll_s=args.poll_s))
