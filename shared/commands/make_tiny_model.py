"""``mobizo make-tiny-model``: a small seeded Llama for demos and tests, since nothing can be downloaded."""

from __future__ import annotations

import argparse
from pathlib import Path

from shared.errors import ExitCode

HELP = "write a small seeded Llama-architecture model (Hugging Face layout) with a byte-level BPE tokenizer"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="folder to write (replaced if it holds a model)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed; the same seed gives identical files")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size, a multiple of 8 (default 64)")
    parser.add_argument("--vocab", type=int, default=512, help="vocabulary size, at least 259 (default 512)")


def run(args: argparse.Namespace) -> ExitCode:
    from shared.hf_models import count_params, load_model
    from shared.tiny_model import make_tiny_model

    out = make_tiny_model(args.out, seed=args.seed, layers=args.layers, hidden=args.hidden, vocab=args.vocab)
    model, tokenizer = load_model(out)
    files = ", ".join(sorted(p.name for p in out.iterdir()))
    print(f"wrote {out}: {count_params(model):,} parameters, vocabulary {len(tokenizer)} tokens ({files})")
    return ExitCode.OK
