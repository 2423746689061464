"""``mobizo run-program``: run a training program with the ExecuTorch runtime on local data, as a device would.

The program is ``FILE.pte`` with its manifest ``FILE.json`` beside it; its weights (``weights-<sha>.ptd``) and
tokenizer (``tokenizer-<sha>.json``) are in ``--store`` (default: the program's folder), as ``mobizo export``
writes them. The data is tokenized here with the program's tokenizer, and step k uses the examples and seed that
``mobizo train`` would (``device_agent.local_data``), so the two agree step by step.

Writes ``OUT/train_log.jsonl`` (replayable: ``mobizo replay --init OUT/init_adapter --log OUT/train_log.jsonl``, with
``--optimizer`` when the program's is not sgd),
``OUT/init_adapter/`` (A and the starting B: ``FILE.init.safetensors`` when the program was exported with
``--adapter``, else zeros; the program itself carries no B), ``OUT/adapter/`` (A and the trained B) and
``OUT/metrics.json``. With ``--eval``, accuracy and loss before and after training come from the program's own
``evaluate`` method (``device_agent.evaluation`` says why).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shared.manifest import ProgramManifest

from shared.errors import ExitCode

HELP = "run a training program with the ExecuTorch runtime on local data, as a device would"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from shared import defaults
    from shared.schedule import SCHEDULES
    from shared.tasks import BUCKET_HELP

    add = parser.add_argument
    add("--program", required=True, type=Path, metavar="FILE.pte", help="the program (manifest FILE.json beside it)")
    add("--task", required=True, help="sst2, rte, wnli, boolq, wic, wsc, cb, copa, lm, or custom")
    add("--train", required=True, type=Path, metavar="FILE", help="training examples (JSON Lines)")
    job = "default: a job's for the program's objective and weights, as the server would lease it"
    add("--steps", type=int, help=f"training steps ({job})")
    add("--lr", type=float, help=f"base learning rate, the schedule's peak ({job})")
    add(
        "--lr-schedule",
        choices=SCHEDULES,
        help=f"lr over the steps after warm-up: constant, or linear / cosine decay to --lr-floor ({job}); each "
        "step's lr goes into its batch record",
    )
    add(
        "--warmup-steps",
        type=int,
        default=defaults.WARMUP_STEPS,
        metavar="W",
        help=f"raise lr linearly over the first W steps, lr*(k+1)/W at step k; W < --steps (default "
        f"{defaults.WARMUP_STEPS})",
    )
    add(
        "--lr-floor",
        type=float,
        default=defaults.LR_FLOOR,
        metavar="F",
        help=f"where linear and cosine decay end, as a fraction of --lr in [0, 1] (default {defaults.LR_FLOOR:g})",
    )
    add("--eps", type=float, help=f"perturbation scale ({job})")
    add("--seed", type=int, default=0, help="run seed: batch order and step seeds (default 0)")
    add("--bucket", type=int, default=defaults.BUCKET, metavar="B", help=f"{BUCKET_HELP} (default {defaults.BUCKET})")
    add("--eval", type=Path, metavar="FILE", help="held-out examples: accuracy and loss before and after training")
    add("--template", help='custom task: prompt with {field} placeholders, e.g. "{text} It was"')
    add("--verbalizer", metavar="JSON", help='custom task: e.g. {"0": " terrible", "1": " great"}')
    add("--store", type=Path, metavar="DIR", help="where the .ptd and tokenizer are (default: beside the program)")
    add("--out", required=True, type=Path, metavar="DIR", help="output folder")
    add("--json", action="store_true", help="print the metrics as JSON")


def _check(args: argparse.Namespace) -> tuple[ProgramManifest, Path, Path]:
    """Validate the arguments (``UsageError`` naming the field) → (manifest, .ptd path, tokenizer path)."""
    from shared.errors import UsageError
    from shared.manifest import manifest_path, read_manifest
    from shared.noise import MAX_SEED
    from shared.schedule import check_schedule

    if args.program.suffix != ".pte" or not args.program.is_file():
        raise UsageError("program", f"{args.program} is not a .pte file")
    if not manifest_path(args.program).is_file():
        raise UsageError("program", f"no manifest {manifest_path(args.program).name} beside the program")
    for name, path in (("train", args.train), ("eval", args.eval)):
        if path is not None and not path.is_file():
            raise UsageError(name, f"no such file: {path}")
    manifest = read_manifest(args.program)
    with_job_defaults(args, manifest)
    if args.steps < 1:
        raise UsageError("steps", f"must be at least 1, got {args.steps}")
    if args.bucket < 1:
        raise UsageError("bucket", f"must be at least 1, got {args.bucket}")
    for name, value in (("lr", args.lr), ("eps", args.eps)):
        if not (math.isfinite(value) and value > 0):
            raise UsageError(name, f"must be a positive number, got {value}")
    if not 0 <= args.seed < MAX_SEED:
        raise UsageError("seed", f"must be in [0, 2**31), got {args.seed}")
    check_schedule(args.steps, args.lr_schedule, args.warmup_steps, args.lr_floor)
    store = args.store or args.program.parent
    files = [store / entry.file for entry in (manifest.ptd, manifest.tokenizer)]
    for path in files:
        if not path.is_file():
            raise UsageError("store", f"{path.name} (named by the manifest) is not in {store}")
    return manifest, files[0], files[1]


def with_job_defaults(args: argparse.Namespace, manifest: ProgramManifest) -> None:
    """Fill the steps, lr, schedule and eps not given with a job's defaults for the program's objective and base
    weights (``shared.defaults.for_method``): the same flags then give what a device leased that job runs."""
    from shared import defaults

    tuned = defaults.for_method(defaults.METHOD, manifest.config.quantize, manifest.config.objective)
    for name in ("steps", "lr", "lr_schedule", "eps"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(tuned, name))


def _initial_b(program: Path, manifest: ProgramManifest):  # -> np.ndarray
    """B before step 1, which the program does not carry: its ``export --adapter`` B file, else zeros."""
    import numpy as np

    from shared.b_file import read_b_file
    from shared.errors import DataError, UsageError

    if manifest.init_b is None:
        return np.zeros(manifest.lora_size, np.float32)
    path = program.parent / manifest.init_b.file
    try:
        return read_b_file(path, manifest.lora_size)
    except (OSError, DataError) as exc:
        raise UsageError("program", f"its starting B {path.name} (named by the manifest): {exc}") from None


@dataclass
class _Run:
    """A run-program run: the program loaded, the data tokenized, what it has produced so far."""

    manifest: ProgramManifest
    session: Any  # device_agent.et_program.ProgramSession
    tokenizer: Any
    shape: Any  # device_agent.batches.Shape
    kind: str  # the task's kind (accuracy is None for lm)
    held_out: list | None
    log: list[dict] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)

    def evaluate(self, step: int) -> None:
        from device_agent.evaluation import evaluate_program

        if self.held_out is not None:
            config = self.manifest.config
            result = evaluate_program(
                self.session, self.held_out, self.tokenizer, self.shape, self.kind, config.candidates, config.prior
            )
            self.evals.append({"step": step, **result})


def _train(run: _Run, batches: list, eps: float) -> None:
    """Every step at its batch's lr, with a progress bar on a terminal; the log records each step's float32 lr and
    eps as the program saw them."""
    from tqdm import tqdm

    from device_agent.backends.local import run_steps
    from shared.train_log import log_record

    with tqdm(total=len(batches), desc="run-program", unit="step", disable=not sys.stderr.isatty()) as bar:

        def on_step(record) -> None:
            run.log.append(log_record(record.step, record.seed, record.lr, eps, record.g, record.losses))
            run.seconds.append(record.seconds)
            bar.update()
            bar.set_postfix(loss=f"{float(record.losses.mean()):.4f}", refresh=False)

        run_steps(run.session, batches, eps, 0, on_step, lambda: False)


def _write(run: _Run, args: argparse.Namespace, init_b, n_train: int) -> dict[str, Any]:
    from device_agent.metrics import training_metrics
    from shared.adapter import save_program_adapter
    from shared.files import atomic_write_bytes
    from shared.train_log import log_line

    base_model = run.manifest.model or ""
    args.out.mkdir(parents=True, exist_ok=True)
    save_program_adapter(args.out / "init_adapter", run.manifest, init_b, base_model)
    save_program_adapter(args.out / "adapter", run.manifest, run.session.get_b(), base_model)
    atomic_write_bytes(args.out / "train_log.jsonl", "".join(map(log_line, run.log)).encode())
    extra = {
        "seed": args.seed,
        "lr": args.lr,
        "lr_schedule": args.lr_schedule,
        "warmup_steps": args.warmup_steps,
        "lr_floor": args.lr_floor,
        "eps": args.eps,
        "task": args.task,
        "backend": "executorch",
        "eval": run.evals,
        "n_train": n_train,
        "program": str(args.program),
    }
    metrics = training_metrics(run.manifest, run.log, run.seconds, extra)
    atomic_write_bytes(args.out / "metrics.json", (json.dumps(metrics, indent=2) + "\n").encode())
    return metrics


def run(args: argparse.Namespace) -> ExitCode:
    import numpy as np

    from device_agent.et_program import ProgramSession
    from device_agent.local_data import program_shape, step_batches
    from shared.data import load_examples
    from shared.tasks import get_task, parse_verbalizer
    from shared.tokenizer_file import load_tokenizer_file

    manifest, ptd, tokenizer_file = _check(args)
    task = get_task(args.task, args.template, parse_verbalizer(args.verbalizer))
    shape, tokenizer = program_shape(manifest.config), load_tokenizer_file(tokenizer_file)
    examples = load_examples(task, args.train)
    held_out = load_examples(task, args.eval) if args.eval is not None else None
    schedule = (args.lr_schedule, args.warmup_steps, args.lr_floor)
    candidates = manifest.config.candidates
    run = (args.seed, args.steps, args.lr, *schedule, candidates, None, manifest.config.optimizer, args.bucket)
    batches = list(step_batches(examples, tokenizer, shape, *run))
    session = ProgramSession(args.program, ptd, widths=manifest.inputs.widths)
    state = _Run(manifest, session, tokenizer, shape, task.kind, held_out)
    init_b = _initial_b(args.program, manifest)
    state.session.set_b(init_b)
    state.evaluate(0)
    _train(state, batches, float(np.float32(args.eps)))
    state.evaluate(args.steps)
    metrics = _write(state, args, init_b, len(examples))
    print(json.dumps(metrics) if args.json else _summary(metrics, args.out))
    return ExitCode.OK


def _summary(metrics: dict[str, Any], out: Path) -> str:
    lines = [
        f"mobizo q={metrics['q']} E={metrics['examples_per_query']} on executorch: {metrics['steps']} steps, "
        f"last loss {metrics['losses'][-1]:.4f}, {metrics['step_time_s']:.4f} s/step (median), "
        f"peak RSS {metrics['peak_rss_mb']:.0f} MB"
    ]
    for entry in metrics["eval"]:
        accuracy = "" if entry["accuracy"] is None else f"accuracy {entry['accuracy']:.4f}, "
        lines.append(f"eval at step {entry['step']}: {accuracy}loss {entry['loss']:.4f}")
    lines.append(f"wrote adapter/, init_adapter/, train_log.jsonl, metrics.json in {out}")
    return "\n".join(lines)
