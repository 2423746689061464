"""``mobizo train``: fine-tune in PyTorch on this machine (CPU or CUDA) and write OUT/adapter/ and OUT/metrics.json.

Flags that are not given keep ``shared.train.TrainConfig``'s defaults (``shared.defaults``, which the help shows);
every check of the values happens in ``shared.train.validate`` and names the field (shown as its flag).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from shared import defaults
from shared.backends import OBJECTIVE_HELP, OBJECTIVES, OPTIMIZERS, PROBE_WEIGHTS, PROBE_WEIGHTS_HELP
from shared.errors import ExitCode
from shared.schedule import SCHEDULES
from shared.tasks import BUCKET_HELP, BUILTIN_HELP, CALIBRATE_HELP, TEMPLATE_HELP, VERBALIZER_HELP, parse_verbalizer

HELP = "fine-tune a model on a task with MobiZO or a baseline; writes OUT/adapter/ and OUT/metrics.json"

_KEEP = argparse.SUPPRESS  # an absent flag leaves TrainConfig's default


def _targets(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        f"Defaults of --steps, --lr, --lr-schedule, --eps and --rank by method and objective: {defaults.describe()}."
    )
    add = parser.add_argument
    add("--model", required=True, type=Path, metavar="DIR", help="Hugging Face model folder")
    add("--task", required=True, help="sst2, rte, wnli, boolq, wic, wsc, cb, copa, lm, or custom")
    add("--train", required=True, type=Path, metavar="FILE", help="training examples (JSON Lines)")
    add(
        "--eval",
        default=_KEEP,
        type=Path,
        metavar="FILE",
        help="held-out examples: accuracy and loss before, during (--eval-every) and after training",
    )
    add("--out", required=True, type=Path, metavar="DIR", help="output folder: adapter/, metrics.json, train_log.jsonl")
    add(
        "--method",
        default=_KEEP,
        help="mobizo (default), mezo-lora, mezo (full parameters, no adapter), or "
        "fo-lora (backprop); all but mobizo need --q 1",
    )
    add(
        "--q",
        default=_KEEP,
        type=int,
        help=f"queries per step (default {defaults.Q} for mobizo, the benchmark's best at batch "
        f"{defaults.BATCH_SIZE}; 1 for the other methods); must divide --batch-size",
    )
    add(
        "--batch-size",
        default=_KEEP,
        type=int,
        help=f"examples per step, E = batch-size / q per query (default {defaults.BATCH_SIZE})",
    )
    add("--bucket", default=_KEEP, type=int, metavar="B", help=BUCKET_HELP)
    add("--steps", default=_KEEP, type=int, help="training steps (default: per method, below)")
    add("--lr", default=_KEEP, type=float, help="base learning rate, the schedule's peak (default: per method, below)")
    add(
        "--lr-schedule",
        default=_KEEP,
        choices=SCHEDULES,
        help="lr over the steps after warm-up: constant, or linear / cosine decay from --lr to --lr-floor "
        "(default: per objective, below)",
    )
    add(
        "--warmup-steps",
        default=_KEEP,
        type=int,
        metavar="W",
        help=f"raise lr linearly over the first W steps, lr*(k+1)/W at step k; W < --steps "
        f"(default {defaults.WARMUP_STEPS})",
    )
    add(
        "--lr-floor",
        default=_KEEP,
        type=float,
        metavar="F",
        help=f"where linear and cosine decay end, as a fraction of --lr in [0, 1] (default {defaults.LR_FLOOR:g})",
    )
    add("--eps", default=_KEEP, type=float, help="perturbation scale of the ZO methods (default: per method, below)")
    add("--rank", default=_KEEP, type=int, help="LoRA rank (default: per objective, below)")
    add(
        "--alpha",
        default=_KEEP,
        type=float,
        help=f"LoRA alpha; scaling alpha/rank (default {defaults.SCALING:g} x rank)",
    )
    add(
        "--targets",
        default=_KEEP,
        type=_targets,
        help=f"comma-separated linear modules (default {','.join(defaults.TARGETS)})",
    )
    add("--seed", default=_KEEP, type=int, help=f"run seed: batch order and step seeds (default {defaults.SEED})")
    add("--parallel", default=_KEEP, help="mobizo schedule: both (default), outer, inner, or none")
    add("--objective", default=_KEEP, choices=OBJECTIVES, help=OBJECTIVE_HELP)
    add(
        "--optimizer",
        default=_KEEP,
        choices=OPTIMIZERS,
        help="how a step's g moves B (mobizo, eager): sgd (default), momentum (beta 0.9, an average of the steps' "
        "directions) or normalized (the step divided by the running RMS of g); the log replays with the same "
        "--optimizer",
    )
    add("--probe-weights", default=_KEEP, choices=PROBE_WEIGHTS, help=PROBE_WEIGHTS_HELP)
    add("--dtype", default=_KEEP, help="float32 (default), bfloat16, float16, or float64 (exactness checks)")
    add(
        "--dp-epsilon",
        default=_KEEP,
        type=float,
        metavar="E",
        help="train privately (mobizo): (E, --dp-delta)-differential privacy for the training examples; each "
        "example's projected difference is clipped to --dp-clip, each g noised, batches sampled without "
        "replacement; the log holds the noised g alone (no losses); metrics.json says the epsilon spent",
    )
    add("--dp-delta", default=_KEEP, type=float, metavar="D", help="the private run's delta (default 1e-5)")
    add(
        "--dp-clip",
        default=_KEEP,
        type=float,
        metavar="C",
        help=f"a private run's clip of each example's projected difference (default {defaults.DP_CLIP:g})",
    )
    add("--eval-every", default=_KEEP, type=int, metavar="K", help="also evaluate every K steps")
    add(
        "--checkpoint-every",
        default=_KEEP,
        type=int,
        metavar="K",
        help="write OUT/checkpoint/ every K steps; the same command run again continues from it (or a longer "
        "--steps extends a constant-schedule run); not for mezo",
    )
    add("--device", default=_KEEP, help="cpu or cuda (default: cuda when available)")
    add("--limit-train", default=_KEEP, type=int, metavar="N", help="use only the first N training examples")
    add("--limit-eval", default=_KEEP, type=int, metavar="N", help="use only the first N held-out examples")
    add(
        "--seq-len",
        default=_KEEP,
        type=int,
        metavar="N",
        help="maximum tokens per row: prompts are cut from the left to fit N (default: no cut)",
    )
    add("--template", default=_KEEP, help=TEMPLATE_HELP)
    add("--verbalizer", default=_KEEP, metavar="JSON", help=VERBALIZER_HELP)
    add("--calibrate", action="store_true", default=_KEEP, help=CALIBRATE_HELP)
    add("--prompt", choices=("model", "builtin"), default=_KEEP, help=BUILTIN_HELP)
    add(
        "--chat-template",
        action="store_true",
        default=_KEEP,
        help="put each prompt inside the model's chat template (instruct models); answers lose their leading space",
    )
    add("--json", action="store_true", help="print the metrics as JSON")


def _summary(metrics: dict) -> str:
    """A few lines for people; --json and metrics.json are for scripts."""
    per_query = f" q={metrics['q']} E={metrics['examples_per_query']}" if metrics["method"] == "mobizo" else ""
    lines = [
        f"{metrics['method']}{per_query}: {metrics['steps']} steps, last loss {metrics['losses'][-1]:.4f}, "
        f"{metrics['step_time_s']:.4f} s/step (median), peak RSS {metrics['peak_rss_mb']:.0f} MB"
    ]
    for entry in metrics["eval"]:
        accuracy = "" if entry["accuracy"] is None else f"accuracy {entry['accuracy']:.4f}, "
        lines.append(f"eval at step {entry['step']}: {accuracy}loss {entry['loss']:.4f}")
    written = [name + "/" for name in [metrics["adapter"]] if name] + [n for n in [metrics["train_log"]] if n]
    lines.append(f"wrote {', '.join(written + ['metrics.json'])} in {metrics['out']}")
    if "note" in metrics:
        lines.append(metrics["note"])
    return "\n".join(lines)


def run(args: argparse.Namespace) -> ExitCode:
    from shared.prompts import notice
    from shared.train import TrainConfig, train, with_defaults

    given = {name: value for name, value in vars(args).items() if name in TrainConfig.__dataclass_fields__}
    if "verbalizer" in given:
        given["verbalizer"] = parse_verbalizer(given["verbalizer"])
    config = TrainConfig(**given)
    resolved = with_defaults(config)
    if (line := notice(config.task, config.template, resolved.template)) is not None:
        print(line, file=sys.stderr)
    metrics = train(config, progress=sys.stderr.isatty())
    print(json.dumps(metrics) if args.json else _summary(metrics))
    return ExitCode.OK
