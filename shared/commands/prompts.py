"""``mobizo prompts``: choose a built-in task's prompt for a model by zero-shot accuracy on training rows."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from shared.errors import ExitCode, UsageError
from shared.files import atomic_write_bytes

HELP = "prompts: choose a task's template, answers and chat frame for a model, on training rows"


def add_subcommands(subcommands: argparse._SubParsersAction) -> None:
    search = subcommands.add_parser(
        "search",
        help="score every candidate prompt of a task zero-shot on training rows, best first",
        description="Score every candidate prompt of a built-in task (templates x answers, with and without the "
        "model's chat frame; shared.prompts) by zero-shot accuracy on training rows, and print them best first "
        "with the flags that use the best one (--task TASK --template ... --verbalizer ...; --write-model makes it "
        "the model's for the task). A file named like "
        "a held-out split (validation, test, dev, eval) is refused: the prompt is chosen on training rows only.",
    )
    search.add_argument("--model", required=True, metavar="DIR", help="Hugging Face model folder")
    search.add_argument("--task", required=True, help="built-in task with candidates: sst2, rte or boolq")
    search.add_argument("--data", required=True, metavar="FILE", help="training rows, JSON Lines")
    search.add_argument("--limit", type=int, default=200, metavar="N", help="the first N rows (default 200)")
    search.add_argument("--batch-size", type=int, default=16, metavar="N", help="rows per forward pass")
    search.add_argument("--seq-len", type=int, metavar="N", help="maximum tokens per row (prompts cut from the left)")
    search.add_argument("--no-chat", action="store_true", help="leave out the candidates in the chat frame")
    search.add_argument("--json", action="store_true", help="print every candidate's scores as JSON")
    search.add_argument("--write", type=Path, metavar="FILE", help="save the best prompt (JSON) here")
    search.add_argument(
        "--write-model",
        action="store_true",
        help="record the best prompt as the model's for the task (MODEL/mobizo_prompts.json): jobs, mobizo train, "
        "eval and export that name the task and no prompt of their own then read it through this one",
    )
    search.set_defaults(_run=run_search, _parser=search)


def _check(args: argparse.Namespace) -> None:
    from shared.prompts import check_selection_data

    if not Path(args.model).is_dir():
        raise UsageError("model", f"no such directory: {args.model}")
    if not Path(args.data).is_file():
        raise UsageError("data", f"no such file: {args.data}")
    check_selection_data(Path(args.data))
    for name in ("limit", "batch_size"):
        if getattr(args, name) < 1:
            raise UsageError(name, f"must be at least 1, got {getattr(args, name)}")


def _shell(text: str) -> str:
    """``text`` as one shell word: ANSI-C quoting (``$'...'``) where it holds a newline, else ``shlex.quote``."""
    if "\n" in text or "\t" in text:
        escaped = text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n").replace("\t", "\\t")
        return f"$'{escaped}'"
    return shlex.quote(text)


def run_search(args: argparse.Namespace) -> ExitCode:
    _check(args)
    from shared.data import load_examples
    from shared.evaluate import evaluate
    from shared.hf_models import load_model
    from shared.model_files import has_chat_template
    from shared.prompts import candidates
    from shared.tasks import chat_frame

    chat = not args.no_chat and has_chat_template(Path(args.model))
    prompts = candidates(args.task, chat)
    model, tokenizer = load_model(Path(args.model))
    frame = chat_frame(tokenizer) if chat else None
    scored = []
    for i, prompt in enumerate(prompts, 1):
        task = prompt.task(frame)
        rendered = load_examples(task, args.data, args.limit)
        metrics = evaluate(model, tokenizer, task, rendered, args.batch_size, args.seq_len)
        scored.append({**prompt.as_dict(), **metrics})
        if sys.stderr.isatty():
            print(f"\r{i}/{len(prompts)} prompts scored", end="", file=sys.stderr, flush=True)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    scored.sort(key=lambda s: -s["accuracy"])  # losses are not compared: a candidate's objective is its own
    if args.write is not None:
        best = {"task": args.task, "data": str(args.data), **scored[0]}
        atomic_write_bytes(args.write, (json.dumps(best, indent=2) + "\n").encode())
    if args.write_model:
        from shared.prompts import write_model_prompt

        chosen_on = f"{Path(args.data).name}, first {scored[0]['n']} rows"
        entry = {**{k: scored[0][k] for k in ("template", "verbalizer", "chat_template", "accuracy")}}
        written = write_model_prompt(Path(args.model), args.task, entry | {"chosen_on": chosen_on})
        print(f"wrote the best prompt for {args.task} to {written}", file=sys.stderr)
    if args.json:
        print(json.dumps(scored))
        return ExitCode.OK
    print(f"{args.task}: {len(scored)} prompts, zero-shot on {scored[0]['n']} rows of {args.data}, best first")
    print("| accuracy | loss (objective) | chat | template | answers |\n|---|---|---|---|---|")
    for s in scored:
        answers = " / ".join(repr(v) for v in s["verbalizer"].values())
        print(
            f"| {s['accuracy']:.3f} | {s['loss']:.3f} ({s['objective']}) | {'yes' if s['chat_template'] else 'no'} | "
            f"{s['template']!r} | {answers} |"
        )
    best = scored[0]
    verbalizer = _shell(json.dumps(best["verbalizer"]))
    flags = f"--task {args.task} --template {_shell(best['template'])} --verbalizer {verbalizer}"
    print(f"the best: {flags}{' --chat-template' if best['chat_template'] else ''}")
    return ExitCode.OK
