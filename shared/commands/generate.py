"""``mobizo generate``: text from a base model, or base + PEFT adapter, in eager PyTorch, streamed as produced.

The host reference of on-device inference (``mobizo agent generate`` runs the same loop, ``shared.generation``,
on the ExecuTorch inference program); the adapter is applied by PEFT itself, so the comparison is independent of
mobizo's own LoRA layers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from shared.errors import ExitCode, UsageError

HELP = "generate text from a model or model + adapter (eager PyTorch + PEFT), tokens printed as produced"


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every generate command shares (also ``mobizo agent generate``)."""
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="at most N new tokens (64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sampling")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of mass P (1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampler (0)")
    parser.add_argument(
        "--json", action="store_true", help="one JSON line per token (id, text, seconds), then the timings"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from shared.commands.eval import add_adapter_arguments

    parser.add_argument("--model", required=True, metavar="DIR", help="Hugging Face model folder")
    add_adapter_arguments(parser)
    add_sampling_arguments(parser)


def sampling_from(args: argparse.Namespace):
    from shared.generation import Sampling

    return Sampling(temperature=args.temperature, top_p=args.top_p, seed=args.seed)


def stream(steps, tokenizer, prompt_tokens: int, as_json: bool) -> dict:
    """Print each token as it comes (text, or a JSON line with its step time); return the timings summary."""
    from shared.generation import TextStream, summary

    text, done = TextStream(tokenizer), []
    for generated in steps:
        done.append(generated)
        piece = text.push(generated.token)
        if as_json:
            print(json.dumps({"token": generated.token, "text": piece, "seconds": round(generated.seconds, 6)}))
        else:
            print(piece, end="", flush=True)
        sys.stdout.flush()
    timings = summary(prompt_tokens, done) | {"text": tokenizer.decode(text.ids, skip_special_tokens=True)}
    if as_json:
        print(json.dumps({"event": "done"} | timings))
    else:
        print()
        rate = timings["decode_tokens_per_s"]
        print(
            f"{len(done)} tokens; prefill {timings['prefill_tokens_per_s']} tok/s, decode {rate} tok/s", file=sys.stderr
        )
    return timings


def run(args: argparse.Namespace) -> ExitCode:
    if not Path(args.model).is_dir():
        raise UsageError("model", f"no such directory: {args.model}")
    if args.adapter is not None and not Path(args.adapter).is_dir():
        raise UsageError("adapter", f"no such directory: {args.adapter}")
    if args.adapter is not None:
        from shared.commands.eval import checked_base

        checked_base(args)
    sampling = sampling_from(args)
    from shared.data import prompt_token_ids
    from shared.generation import EagerStepper, generate, stop_token_ids
    from shared.hf_models import load_model

    model, tokenizer = load_model(Path(args.model), "float32")
    if args.adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, args.adapter).eval()
    ids = prompt_token_ids(tokenizer, args.prompt)
    stop = stop_token_ids(tokenizer, model.generation_config.eos_token_id)
    steps = generate(EagerStepper(model), ids, args.max_new_tokens, sampling, stop)
    stream(steps, tokenizer, len(ids), args.json)
    return ExitCode.OK
