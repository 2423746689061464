"""``mobizo export``: compile a Mobile MP-LoRA training program (.pte + shared .ptd + manifest)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from shared.errors import ExitCode

if TYPE_CHECKING:
    from shared.program import ProgramConfig

HELP = "compile a Mobile MP-LoRA training program for the ExecuTorch runtime"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, type=Path, help="Hugging Face model directory")
    parser.add_argument("--task", required=True, help="task name (fixes the answer length); see `mobizo train`")
    parser.add_argument("--q", required=True, type=int, help="queries per step (outer-loop paths)")
    parser.add_argument("--batch-size", required=True, type=int, help="total examples per step (E = batch/q)")
    parser.add_argument(
        "--seq-len",
        required=True,
        type=int,
        metavar="N",
        help="the program's fixed width in tokens: every row is left-padded, or its prompt cut from the left, to N",
    )
    parser.add_argument("--answer-len", type=int, help="answer tokens per row (default: the task's longest answer)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--targets", default="q_proj,v_proj", help="comma-separated target module names")
    parser.add_argument("--a-seed", type=int, default=0, help="seed of the frozen LoRA A")
    parser.add_argument("--backend", choices=("xnnpack", "portable"), default="xnnpack")
    parser.add_argument("--adapter", type=Path, help="start from this adapter's B (continued personalization)")
    parser.add_argument("--template", help="custom task: prompt template with {field} placeholders")
    parser.add_argument("--verbalizer", help='custom task: JSON {"label": "answer text", ...}')
    parser.add_argument("--store", type=Path, help="where the shared .ptd and tokenizer go (default: beside --out)")
    parser.add_argument("--out", required=True, type=Path, help="the program file to write (FILE.pte)")


def config_from_args(args: argparse.Namespace, tokenizer) -> ProgramConfig:
    """Validate the arguments (UsageError naming the flag) and build the program config."""
    from shared.errors import UsageError
    from shared.program import ProgramConfig
    from shared.tasks import answer_len_for, get_task, parse_verbalizer

    for flag, value in (
        ("--q", args.q),
        ("--batch-size", args.batch_size),
        ("--seq-len", args.seq_len),
        ("--rank", args.rank),
    ):
        if value < 1:
            raise UsageError(flag, f"must be >= 1 (got {value})")
    if args.batch_size % args.q:
        raise UsageError("--q", f"{args.q} does not divide --batch-size {args.batch_size}")
    task = get_task(args.task, args.template, parse_verbalizer(args.verbalizer))
    answer_len = args.answer_len or answer_len_for(task, tokenizer)
    if answer_len >= args.seq_len:
        raise UsageError("--seq-len", f"{args.seq_len} leaves no room for a prompt before {answer_len} answer tokens")
    targets = tuple(t for t in args.targets.split(",") if t)
    return ProgramConfig(
        args.q, args.batch_size, args.seq_len, answer_len, args.rank, args.alpha, targets, args.a_seed, args.backend
    )


def run(args: argparse.Namespace) -> ExitCode:
    from shared.errors import UsageError
    from shared.models import load_model
    from shared.program import export_program

    if not (args.model / "config.json").is_file():
        raise UsageError("--model", f"{args.model} is not a Hugging Face model directory")
    if args.adapter is not None and not args.adapter.is_dir():
        raise UsageError("--adapter", f"{args.adapter} is not an adapter directory")
    if args.out.suffix != ".pte":
        raise UsageError("--out", "must name a .pte file")
    _, tokenizer = load_model(args.model)
    cfg = config_from_args(args, tokenizer)
    export_program(args.model, cfg, args.out, args.store, args.adapter)
    return ExitCode.OK
