"""``mobizo adapters merge``: an adapter folded into its base, a plain Hugging Face model for runtimes without LoRA
(the registry's commands, ``adapters list|download``, are the server package's)."""

from __future__ import annotations

import argparse
from pathlib import Path

from shared.backends import MERGE_DTYPES
from shared.errors import ExitCode, UsageError

HELP = "fold an adapter into its base model: a plain Hugging Face model folder (no LoRA needed to run it)"


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    from shared.commands.eval import ALLOW_OTHER_BASE_HELP

    merge = sub.add_parser("merge", help=HELP, description=HELP)
    merge.set_defaults(_run=run, _parser=merge)
    merge.add_argument("--model", required=True, type=Path, metavar="DIR", help="the base model (Hugging Face folder)")
    merge.add_argument("--adapter", required=True, type=Path, metavar="DIR", help="the adapter folder (PEFT layout)")
    merge.add_argument("--out", required=True, type=Path, metavar="DIR", help="the folder to write (must not exist)")
    merge.add_argument(
        "--dtype",
        default="float32",
        choices=MERGE_DTYPES,
        help="the merged weights' type (float32, the default, keeps the merge's own rounding only)",
    )
    merge.add_argument("--allow-other-base", action="store_true", help=ALLOW_OTHER_BASE_HELP)


def run(args: argparse.Namespace) -> ExitCode:
    from shared.adapter import CONFIG_FILE, merge_adapter
    from shared.commands.eval import checked_base

    if not (args.model / "config.json").is_file():
        raise UsageError("model", f"{args.model} is not a Hugging Face model folder (no config.json)")
    if not (args.adapter / CONFIG_FILE).is_file():
        raise UsageError("adapter", f"{args.adapter} is not an adapter folder (no {CONFIG_FILE})")
    if args.out.exists():
        raise UsageError("out", f"{args.out} exists: choose another folder")
    checked_base(args)
    out = merge_adapter(args.model, args.adapter, args.out, args.dtype)
    print(f"merged {args.adapter} into {args.model}: {out} ({args.dtype}; loads with AutoModelForCausalLM)")
    return ExitCode.OK
