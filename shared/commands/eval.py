"""``mobizo eval``: accuracy (or loss) of a base model, or base model + adapter, on a task's JSON Lines data."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from shared.backends import OBJECTIVE_HELP, OBJECTIVES
from shared.errors import ExitCode, UsageError
from shared.tasks import (
    BUILTIN_HELP,
    CALIBRATE_HELP,
    TEMPLATE_HELP,
    VERBALIZER_HELP,
    parse_verbalizer,
)  # light: stdlib only

HELP = "accuracy (or loss) of a base model or base + adapter on a task's data"
ALLOW_OTHER_BASE_HELP = (
    "apply the adapter even to a model other than the base it was trained on (its mobizo_base.json): refused "
    "otherwise, since the outputs would be garbage"
)


AGENT_PROMPT_HELP = (
    "adapter (default): read the task through the prompt the adapter was trained with (its template, verbalizer, "
    "chat frame and calibration prior) when it was trained on this task; builtin: the task's own"
)


def add_adapter_arguments(parser: argparse.ArgumentParser) -> None:
    """--adapter and --allow-other-base (also ``mobizo generate``)."""
    parser.add_argument("--adapter", metavar="DIR", help="PEFT adapter folder to apply to the model")
    parser.add_argument("--allow-other-base", action="store_true", help=ALLOW_OTHER_BASE_HELP)


def add_arguments(parser: argparse.ArgumentParser, model: bool = True) -> None:
    """The flags of ``mobizo eval``; ``model=False`` leaves out --model/--adapter/--device (``mobizo agent eval``)."""
    if model:
        parser.add_argument("--model", required=True, metavar="DIR", help="Hugging Face model folder")
        add_adapter_arguments(parser)
    parser.add_argument(
        "--task", required=True, help="built-in task (sst2, rte, wnli, boolq, wic, wsc, cb, copa), custom, lm or text"
    )
    parser.add_argument("--data", required=True, metavar="FILE", help="JSON Lines examples")
    parser.add_argument("--json", action="store_true", help="print the metrics as JSON")
    parser.add_argument("--limit", type=int, metavar="N", help="only the first N examples")
    parser.add_argument("--batch-size", type=int, default=16, metavar="N", help="rows per forward pass")
    parser.add_argument("--template", help=TEMPLATE_HELP)
    parser.add_argument("--verbalizer", metavar="JSON", help=VERBALIZER_HELP)
    if model:
        parser.add_argument("--calibrate", action="store_true", help=CALIBRATE_HELP)
        parser.add_argument("--prompt", choices=("model", "builtin"), default="model", help=BUILTIN_HELP)
    else:
        parser.add_argument("--prompt", choices=("adapter", "builtin"), default="adapter", help=AGENT_PROMPT_HELP)
    if model:  # a device holds no chat template of its own: it frames prompts as its adapter was trained
        parser.add_argument(
            "--chat-template",
            action="store_true",
            help="put each prompt inside the model's chat template (instruct models)",
        )
    parser.add_argument(
        "--seq-len", type=int, metavar="N", help="maximum tokens per row: prompts are cut from the left to fit N"
    )
    parser.add_argument("--max-len", dest="seq_len", type=int, help=argparse.SUPPRESS)  # the old name, kept working
    if model:
        parser.add_argument("--objective", choices=OBJECTIVES, help="the loss reported: " + OBJECTIVE_HELP)
        parser.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16 or float64")
        parser.add_argument("--device", default="auto", help="cpu, cuda, ... (default: cuda when available)")


def _check_paths(args: argparse.Namespace) -> None:
    """Fail on a mistyped path before the slow model load."""
    if not Path(args.model).is_dir():
        raise UsageError("model", f"no such directory: {args.model}")
    if args.adapter is not None and not Path(args.adapter).is_dir():
        raise UsageError("adapter", f"no such directory: {args.adapter}")
    if not Path(args.data).is_file():
        raise UsageError("data", f"no such file: {args.data}")
    if args.adapter is not None:
        checked_base(args)


def checked_base(args: argparse.Namespace) -> None:
    """``shared.adapter.check_base`` of ``--adapter`` on ``--model``, before the slow model load; the warning of
    ``--allow-other-base`` on stderr."""
    from shared.adapter import check_base

    warning = check_base(Path(args.adapter), Path(args.model), args.allow_other_base)
    if warning is not None:
        print(warning, file=sys.stderr)


def check_numbers(args: argparse.Namespace) -> None:
    """Positive sizes; --seq-len needs room for at least one prompt and one answer token."""
    bounds = (("limit", args.limit, 1), ("batch_size", args.batch_size, 1), ("seq_len", args.seq_len, 2))
    for name, value, least in bounds:
        if value is not None and value < least:
            raise UsageError(name, f"must be at least {least}, got {value}")


def summary(task: str, metrics: dict) -> str:
    """One line for people; --json is for scripts."""
    loss = f"loss {metrics['loss']:.4f}"
    if metrics["accuracy"] is None:
        shown = f", perplexity {metrics['perplexity']:.2f}" if metrics.get("perplexity") is not None else ""
        return f"{task}: {loss}{shown} on {metrics['n']} examples"
    return f"{task}: accuracy {metrics['accuracy']:.4f} ({loss}) on {metrics['n']} examples"


def run(args: argparse.Namespace) -> ExitCode:
    _check_paths(args)
    check_numbers(args)
    import torch

    from shared.adapter import CARD_DATA, adapter_card
    from shared.data import load_examples
    from shared.evaluate import evaluate
    from shared.hf_models import load_model, model_chat_frame
    from shared.prompts import notice, resolve, trained_line, trained_prompt
    from shared.tasks import get_task, with_chat

    given = (args.template, parse_verbalizer(args.verbalizer), args.chat_template)
    card = None if args.adapter is None else adapter_card(Path(args.adapter))
    template, verbalizer, chat = resolve(Path(args.model), args.task, *given, args.prompt, card)
    trained = trained_prompt(args.task, *given, args.prompt, card)
    if trained is not None:
        print(f"{args.task}: {trained_line(trained)} ({CARD_DATA}; --prompt builtin: the task's own)", file=sys.stderr)
    elif (line := notice(args.task, args.template, template)) is not None:
        print(line, file=sys.stderr)
    task = get_task(args.task, template, verbalizer)
    if chat:
        task = with_chat(task, model_chat_frame(Path(args.model)))
    if args.calibrate and task.kind != "classification":
        raise UsageError("calibrate", f"applies to classification tasks, not {task.kind}")
    rendered = load_examples(task, args.data, args.limit)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    model, tokenizer = load_model(Path(args.model), args.dtype, device)
    prior = None if trained is None else tuple(trained["prior"]) or None  # the prior it was trained to divide out
    if args.calibrate and prior is None:
        from shared.evaluate import measure_prior

        prior = measure_prior(model, tokenizer, task, args.seq_len)  # the base model's, before the adapter
    if args.adapter is not None:
        from shared.adapter import load_adapter

        load_adapter(model, Path(args.adapter))
    metrics = evaluate(
        model, tokenizer, task, rendered, args.batch_size, args.seq_len, sys.stderr.isatty(), args.objective, prior
    )
    if prior is not None:
        metrics["prior"] = list(prior)
    print(json.dumps(metrics) if args.json else summary(task.name, metrics))
    return ExitCode.OK
