"""``mobizo make-random-model``: a seeded random-init model of one of the paper's architectures, as a Hugging Face
folder with a tokenizer of the architecture's vocabulary size, so that 1B-class exports and benchmarks run where
nothing can be downloaded."""

from __future__ import annotations

import argparse
from pathlib import Path

from shared.errors import ExitCode

HELP = "write a seeded random-init model of a named architecture (Hugging Face layout, with a byte-level BPE tokenizer)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--arch", required=True, help="tinyllama-1.1b, llama2-7b or smollm2-135m (public config shapes)"
    )
    parser.add_argument("--out", type=Path, required=True, help="folder to write (replaced if it holds a model)")
    parser.add_argument("--seed", type=int, default=0, help="weight and tokenizer seed; the same seed, the same model")
    parser.add_argument(
        "--dtype",
        default="float32",
        help="weights' dtype: float32 (default), bfloat16 or float16 (llama2-7b needs 27 GB of memory in float32)",
    )


def run(args: argparse.Namespace) -> ExitCode:
    from shared.architectures import make_random_model

    out = make_random_model(args.arch, args.out, seed=args.seed, dtype=args.dtype)
    files = ", ".join(sorted(p.name for p in out.iterdir()))
    print(f"wrote {out}: {args.arch} with random weights (seed {args.seed}, {args.dtype}) ({files})")
    return ExitCode.OK
