"""mobizo: personalize LLMs on the user's own device with parallel zeroth-order fine-tuning (MobiZO).

Each subcommand lives in the ``commands`` package of the part that owns it (``shared.commands``,
``server.commands``, ``device_agent.commands``) as a module with ``HELP``, ``add_arguments(parser)`` and
``run(args) -> ExitCode``; this module is the one table of them. Command modules only touch ``argparse`` at import
time, so building the whole parser is cheap.

Exit codes (``shared.errors.ExitCode``): 0 success, 2 bad arguments (message names the argument) or a command whose
part of mobizo is not installed (the message names the extra: ``pip install 'mobizo[server]'``), 1 any other
failure, 130 interrupted.

Each role installs as an extra (``pyproject.toml``): a device has ``mobizo[device]`` (no torch, no server stack),
so a command is only as heavy as what it runs: the parser imports no role's packages, and a command that reaches
for a package of a role not installed says which extra brings it (``ROLE_OF``) rather than a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from shared.errors import ExitCode, MobizoError, SettingError, UsageError

COMMANDS: dict[str, str] = {
    "make-tiny-model": "shared.commands.make_tiny_model",
    "make-random-model": "shared.commands.make_random_model",
    "train": "shared.commands.train",
    "eval": "shared.commands.eval",
    "generate": "shared.commands.generate",
    "export": "shared.commands.export",
    "run-program": "device_agent.commands.run_program",
    "replay": "shared.commands.replay",
    "server": "server.commands.serve",
    "worker": "server.commands.worker",
    "users": "server.commands.users",
    "enroll-code": "server.commands.enroll_code",
    "jobs": "server.commands.jobs",
    "devices": "server.commands.devices",
    "cohorts": "server.commands.cohorts",
    "privacy": "server.commands.privacy",
    "agent": "device_agent.commands.agent",
}

# Groups whose subcommands come from more than one package: each module has ``add_subcommands(subparsers)`` and
# sets ``_run``/``_parser`` on the subcommands it adds.
GROUPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "models": (
        "base models: import a GGUF checkpoint; register and list models on a server",
        ("shared.commands.models", "server.commands.models"),
    ),
    "adapters": (
        "your adapters: list and download them from a server; merge one into its base model",
        ("server.commands.adapters", "shared.commands.adapters"),
    ),
    "prompts": (
        "prompts: choose a task's template, answers and chat frame for a model, on training rows",
        ("shared.commands.prompts",),
    ),
}


# The top-level packages of each role's extra that is not the device's (pyproject.toml): a ModuleNotFoundError for
# one of them means the command needs that extra.
ROLE_OF: dict[str, str] = {
    **dict.fromkeys(
        ("torch", "torchao", "executorch", "transformers", "peft", "gguf", "dp_accounting", "scipy"), "export"
    ),
    **dict.fromkeys(
        (
            "fastapi",
            "starlette",
            "uvicorn",
            "multipart",
            "python_multipart",
            "sqlalchemy",
            "alembic",
            "psycopg",
            "pydantic_settings",
            "celery",
            "kombu",
            "redis",
            "boto3",
            "botocore",
            "prometheus_client",
            "jinja2",
        ),
        "server",
    ),
    **dict.fromkeys(("tokenizers", "safetensors", "tqdm"), "device"),
}


def missing_role(exc: ModuleNotFoundError) -> str | None:
    """The extra whose package ``exc`` did not find, or None when it is not one of a role's packages."""
    return ROLE_OF.get((exc.name or "").partition(".")[0])


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="mobizo", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        cmd = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(cmd)
        cmd.set_defaults(_run=module.run, _parser=cmd)
    for name, (text, module_names) in GROUPS.items():
        group = sub.add_parser(name, help=text, description=text)
        subcommands = group.add_subparsers(dest=f"{name}_command", metavar="SUBCOMMAND", required=True)
        for module_name in module_names:
            importlib.import_module(module_name).add_subcommands(subcommands)
    return parser


def quiet_libraries() -> None:
    """Keep library chatter (torchao's optional kernels, transformers' load bars) out of our output."""
    import logging
    import os
    import warnings

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", module=r"executorch\..*")
    warnings.filterwarnings("ignore", module=r"torch\..*")


def main(argv: list[str] | None = None) -> int:
    quiet_libraries()
    parser = build_parser()
    args = parser.parse_args(argv)  # argparse exits with ExitCode.USAGE itself
    try:
        return int(args._run(args))
    except UsageError as exc:
        args._parser.print_usage(sys.stderr)
        command = args._parser.prog.partition(" ")[2]  # "mobizo export" → "export"
        print(f"{args._parser.prog}: error: {exc.message(command)}", file=sys.stderr)
        return ExitCode.USAGE
    except SettingError as exc:
        print(f"{args._parser.prog}: error: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    except MobizoError as exc:
        print(f"{args._parser.prog}: error: {exc}", file=sys.stderr)
        return ExitCode.FAILURE
    except ModuleNotFoundError as exc:
        role = missing_role(exc)
        if role is None:
            raise
        print(
            f"{args._parser.prog}: error: needs {exc.name.partition('.')[0]}, part of mobizo's {role} role: "
            f"pip install 'mobizo[{role}]'",
            file=sys.stderr,
        )
        return ExitCode.USAGE
    except KeyboardInterrupt:
        print(f"{args._parser.prog}: interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED
