"""``mobizo export``: compile a Mobile MP-LoRA training program (.pte + shared .ptd + manifest)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from shared import defaults
from shared.backends import (
    OBJECTIVE_HELP,
    OBJECTIVES,
    OPTIMIZERS,
    PARALLEL_MODES,
    PROBE_WEIGHTS,
    PROBE_WEIGHTS_HELP,
    PROGRAM_BACKENDS,
    QUANTIZATIONS,
)
from shared.errors import ExitCode
from shared.tasks import BUILTIN_HELP, TEMPLATE_HELP, VERBALIZER_HELP

if TYPE_CHECKING:
    from shared.manifest import ProgramConfig

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
    parser.add_argument("--objective", choices=OBJECTIVES, help=OBJECTIVE_HELP)
    parser.add_argument("--rank", type=int, help="LoRA rank (default: the objective's, as a job's)")
    parser.add_argument("--alpha", type=float, help=f"LoRA alpha (default {defaults.SCALING:g} x rank)")
    parser.add_argument("--targets", default=",".join(defaults.TARGETS), help="comma-separated target module names")
    parser.add_argument("--a-seed", type=int, default=defaults.A_SEED, help="seed of the frozen LoRA A")
    parser.add_argument("--backend", choices=PROGRAM_BACKENDS, default=defaults.PROGRAM_BACKEND)
    parser.add_argument(
        "--parallel",
        choices=PARALLEL_MODES,
        default=defaults.PARALLEL,
        help="how a step groups its 2q paths into forward passes: both (one pass, default), outer (+ and -), "
        "inner (one pass per query), none (2q passes, the MeZO-LoRA way); the same losses and B",
    )
    parser.add_argument(
        "--quantize",
        choices=QUANTIZATIONS,
        default=defaults.QUANTIZE,
        help="the base model's linears: none (float32) or 8da4w (int4 groupwise weights, int8 dynamic activations)",
    )
    parser.add_argument(
        "--group-size", type=int, default=defaults.GROUP_SIZE, help="weights per 4-bit scale (a multiple of 32)"
    )
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="sgd",
        help="how g moves B inside forward: sgd (default), momentum or normalized (a state buffer beside B, with "
        "get_opt_state / set_opt_state; replay the run's log with mobizo replay --optimizer)",
    )
    parser.add_argument("--probe-weights", choices=PROBE_WEIGHTS, default="none", help=PROBE_WEIGHTS_HELP)
    parser.add_argument(
        "--adapter",
        type=Path,
        help="start from this adapter's B (continued personalization): written beside the program as "
        "FILE.init.safetensors, which the device sets before step 1",
    )
    parser.add_argument("--template", help=TEMPLATE_HELP)
    parser.add_argument("--verbalizer", help=VERBALIZER_HELP)
    parser.add_argument("--prompt", choices=("model", "builtin"), default="model", help=BUILTIN_HELP)
    parser.add_argument(
        "--chat-template",
        action="store_true",
        help="devices frame prompts with the model's chat template (stored in the config; sets the answer length)",
    )
    parser.add_argument("--store", type=Path, help="where the shared .ptd and tokenizer go (default: beside --out)")
    parser.add_argument("--out", required=True, type=Path, help="the program file to write (FILE.pte)")


def config_from_args(args: argparse.Namespace, tokenizer) -> ProgramConfig:
    """Build the program config, which checks itself; a bad value is a UsageError naming its field."""
    from pydantic import ValidationError

    from shared.data import resolve_objective
    from shared.errors import usage_error
    from shared.program_config import resolve_program
    from shared.prompts import notice, resolve
    from shared.tasks import chat_frame, get_task, parse_verbalizer, with_chat

    template, verbalizer, chat_template = resolve(
        args.model, args.task, args.template, parse_verbalizer(args.verbalizer), args.chat_template, args.prompt
    )
    chat = chat_frame(tokenizer) if chat_template else None
    if (line := notice(args.task, args.template, template)) is not None:
        print(line, file=sys.stderr)
    task = with_chat(get_task(args.task, template, verbalizer), chat)
    objective = resolve_objective(task, tokenizer, args.objective, args.answer_len)[0]  # the default rank's key
    rank = args.rank if args.rank is not None else defaults.for_method(defaults.METHOD, args.quantize, objective).rank
    spec = {name: getattr(args, name) for name in ("q", "batch_size", "seq_len", "answer_len", "a_seed", "parallel")}
    spec |= {name: getattr(args, name) for name in ("quantize", "group_size", "objective", "optimizer")}
    spec |= {
        "rank": rank,
        "alpha": args.alpha if args.alpha is not None else defaults.alpha_for(rank),
        "targets": tuple(t for t in args.targets.split(",") if t),
        "program_backend": args.backend,
        "probe_weights": args.probe_weights,
    }
    try:
        return resolve_program(spec, task, tokenizer, chat)
    except ValidationError as exc:
        raise usage_error(exc) from None


def run(args: argparse.Namespace) -> ExitCode:
    from shared.errors import UsageError
    from shared.hf_models import load_model
    from shared.program import export_program

    if not (args.model / "config.json").is_file():
        raise UsageError("model", f"{args.model} is not a Hugging Face model directory")
    if args.adapter is not None and not args.adapter.is_dir():
        raise UsageError("adapter", f"{args.adapter} is not an adapter directory")
    if args.out.suffix != ".pte":
        raise UsageError("out", "must name a .pte file")
    if args.adapter is not None:
        from shared.adapter import check_base

        check_base(args.adapter, args.model)  # training goes on from B only on the base B was trained on
    _, tokenizer = load_model(args.model)
    cfg = config_from_args(args, tokenizer)
    export_program(args.model, cfg, args.out, args.store, args.adapter)
    return ExitCode.OK
