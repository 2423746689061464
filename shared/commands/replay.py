"""``mobizo replay``: rebuild B from an initial adapter and a training log alone (no data, no program)."""

from __future__ import annotations

import argparse
from pathlib import Path

from shared.backends import OPTIMIZERS
from shared.errors import ExitCode

HELP = "rebuild a trained adapter from its initial adapter and training log (bit-exact)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--init", required=True, type=Path, help="the adapter the run started from (PEFT directory)")
    parser.add_argument("--log", required=True, type=Path, help="the training log (JSON Lines, one line per step)")
    parser.add_argument("--out", required=True, type=Path, help="directory to write the replayed adapter to")
    parser.add_argument("--compare", type=Path, help="an adapter to compare the result with (exit 1 if B differs)")
    parser.add_argument(
        "--optimizer",
        default="sgd",
        choices=OPTIMIZERS,
        help="the run's optimizer (mobizo train --optimizer; default sgd, as every job's)",
    )


def run(args: argparse.Namespace) -> ExitCode:
    from shared.adapter import read_adapter, save_adapter
    from shared.errors import MobizoError, UsageError
    from shared.lora import flatten_b, unflatten_b
    from shared.replay import replay
    from shared.train_log import read_log

    for field, path, is_dir in (("init", args.init, True), ("log", args.log, False)):
        if not (path.is_dir() if is_dir else path.is_file()):
            raise UsageError(field, f"{path} does not exist")
    config, lora_a, lora_b = read_adapter(args.init)
    log = read_log(args.log, private=None)  # a private job's log (g alone) replays as any other
    b = replay(flatten_b(lora_b), log, args.optimizer)
    replayed = unflatten_b(b, {n: tuple(t.shape) for n, t in lora_b.items()})
    save_adapter(
        args.out,
        lora_a,
        replayed,
        int(config["r"]),
        float(config["lora_alpha"]),
        tuple(config["target_modules"]),
        config.get("base_model_name_or_path", ""),
    )
    print(f"replayed {len(log)} steps (steps {log[0]['step']}..{log[-1]['step']}) into {args.out}")
    if args.compare is not None:
        _, _, other = read_adapter(args.compare)
        worst = float((flatten_b(other) - b).abs().max())
        if worst != 0.0:
            raise MobizoError(f"replayed B differs from {args.compare} (max |diff| {worst:.3g})")
        print(f"identical to {args.compare}")
    return ExitCode.OK
