"""Does a job make a real model better? Test accuracy per task and method in the paper's low-data regime.

Per task, a seeded sample of ``--n-train`` (1,000) training and ``--n-val`` (500) validation examples from the
task data (``--data-dir``, default ``shared.tasks.task_data_dir()``); the test set is the task's validation split
(at most ``--n-test``). BoolQ ships only 32 training examples, so its train and validation samples come from its
3,270-example validation split and it is tested on the rest. The samples the repository ships in ``data/`` hold
too few RTE and BoolQ examples for that draw: name the full sets (``--data-dir`` or ``$MOBIZO_TASK_DATA_DIR``), or
the benchmark stops before it trains, saying so. Methods: ``zero-shot`` (the base model), ``fo-lora`` (backprop
SGD on LoRA-FA B), ``mezo-lora`` (q = 1), ``mobizo-q1``/``-q4``/``-q16`` (q·E = ``--batch-size`` 16 in each), and
``mezo`` (all parameters; optional, not resumable: its state is the whole model).

Each trained method first runs a short pilot (``--pilot-steps``) per learning rate of its grid (``--lr``), all
from the same start and on the same batches; the learning rate whose pilot ends with the lowest validation LOSS
wins (over a short pilot the loss separates learning rates long before the accuracy does), and the winning pilot is
simply continued to ``--steps`` (its checkpoint is a valid start, see ``shared.checkpoint``). Validation accuracy
and loss are recorded every ``--eval-every`` K steps; the table's figure is the TEST accuracy of the adapter at the
best validation accuracy. Training is the loop of ``mobizo train`` (``shared.train.train``); its step is the eager
one (``--runner eager``, the same mathematics as the device program, which the suite checks) or, with ``--runner
program``, the ExecuTorch training program a user's job runs on a device (exported once per configuration into
``OUT/programs/``, run in the ExecuTorch runtime: ``benchmarks.program_steps.ProgramStep``), for the LoRA ZO
methods; ``fo-lora``'s is ExecuTorch's own first-order training program of the same adapter (``shared.fo_program``,
``benchmarks.program_steps.FirstOrderStep``).
Evaluation scores the adapter's B eagerly either way (the scoring of ``mobizo eval``). ``--quantize 8da4w`` trains
through the 8da4w program (at a job's eps for it); the adapter is still scored on the float32 base, which is what a
device's inference program runs it on.

Everything is resumable: data samples, pilots, runs and results are files under ``--out``; runs checkpoint every
K steps (atomically); a finished piece is read back instead of recomputed, so a killed run continues where it
stopped when the same command is run again. Outputs: the table on stdout, ``OUT/results.json`` (curves included)
and ``OUT/curves.png``.

    python -m benchmarks.accuracy --model DIR --tasks sst2,rte,boolq --steps 20000 --device cuda --out runs/acc
    python -m benchmarks.accuracy --model DIR --runner program --methods zero-shot,mobizo-q4 --lr mobizo-q4=1e-2 \
        --tasks sst2 --steps 200 --out runs/acc-program
    python -m benchmarks.accuracy --model DIR --runner program --quantize 8da4w --methods zero-shot,mobizo-q4 \
        --lr mobizo-q4=4e-2 --tasks sst2 --steps 200 --out runs/acc-8da4w
    python -m benchmarks.accuracy --model DIR --methods mobizo-q4 --optimizers sgd,momentum,normalized \
        --lr mobizo-q4=4e-2 --lr mobizo-q4+momentum=4e-2 --lr mobizo-q4+normalized=1.5e-2 --tasks sst2 --out runs/opt

``--optimizers`` runs each mobizo method once per optimizer (``shared.zo_optim``; with ``--runner program``, each
optimizer's own program), as rows ``mobizo-q4+momentum``, ...; a second table gives the steps each took to reach
the validation accuracy that ``sgd`` ended with.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import textwrap
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shared import defaults
from shared.backends import OBJECTIVES, OPTIMIZERS, QUANTIZATIONS
from shared.checkpoint import CHECKPOINT_DIR, load_checkpoint
from shared.data import load_examples, read_jsonl
from shared.evaluate import evaluate
from shared.files import atomic_dir, atomic_write, atomic_write_bytes
from shared.hf_models import load_model, model_chat_frame
from shared.lora import inject_lora
from shared.manifest import ZEROTH_ORDER
from shared.prompts import resolve as resolve_prompt
from shared.schedule import SCHEDULES
from shared.tasks import SAMPLES_DIR, TASK_DATA_ENV, get_task, task_data_dir, with_chat
from shared.train import METRICS_FILE, StepFactory, TrainConfig, train

TASK_FILES = {  # task → (file the train/validation samples come from, test file or None: the rest of the pool)
    "sst2": ("sst2/train.jsonl", "sst2/validation.jsonl"),
    "rte": ("rte/train.jsonl", "rte/validation.jsonl"),
    "boolq": ("superglue/boolq/validation.jsonl", None),
}


@dataclass(frozen=True)
class Method:
    """A table row: the ``mobizo train`` method, its q, perturbation scale and default learning-rate grid."""

    method: str
    q: int = 1
    eps: float = defaults.for_method("mobizo").eps  # the paper's 1e-2 for ZO on LoRA-FA
    lrs: tuple[float, ...] = ()
    optimizer: str = "sgd"  # how g moves B (shared.zo_optim); a row "mobizo-q4+momentum" names another


# The paper's MobiZO grid, widened at the top for SmolLM2: the classification objective learns at 4e-2 there (rank 4)
ZO_LORA_LRS = (4e-2, 2e-2, 1e-2, 3e-3, 1e-3, 5e-4, 1e-4, 5e-5, 1e-5)
METHODS: dict[str, Method | None] = {
    "zero-shot": None,
    "fo-lora": Method("fo-lora", lrs=(1e-2, 1e-3, 1e-4)),
    "mezo-lora": Method("mezo-lora", lrs=ZO_LORA_LRS),
    "mobizo-q1": Method("mobizo", 1, lrs=ZO_LORA_LRS),
    "mobizo-q4": Method("mobizo", 4, lrs=ZO_LORA_LRS),
    "mobizo-q16": Method("mobizo", 16, lrs=ZO_LORA_LRS),
    "mezo": Method("mezo", eps=1e-3, lrs=(1e-6, 5e-7, 1e-7)),  # the paper's MeZO full grid
}
DEFAULT_METHODS = "zero-shot,fo-lora,mezo-lora,mobizo-q1,mobizo-q4,mobizo-q16"
RUNNERS = ("eager", "program")
PROGRAM_METHODS = ("zero-shot", "mezo-lora", "mobizo-q1", "mobizo-q4", "mobizo-q16")  # what --runner program runs


def method_of(name: str) -> Method | None:
    """The row ``name``: a method of ``METHODS``, or a mobizo method with another optimizer (``mobizo-q4+momentum``)."""
    base, _, optimizer = name.partition("+")
    method = METHODS[base]
    return method if not optimizer else replace(method, optimizer=optimizer)


def with_optimizers(methods: list[str], optimizers: list[str]) -> list[str]:
    """Each mobizo row once per optimizer (``sgd`` keeps the plain name), the other rows as they are."""
    rows = []
    for name in methods:
        mobizo = METHODS[name] is not None and METHODS[name].method == "mobizo"
        rows += [name if opt == "sgd" else f"{name}+{opt}" for opt in optimizers] if mobizo else [name]
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--model", required=True, type=Path, metavar="DIR", help="Hugging Face model folder")
    add("--out", required=True, type=Path, metavar="DIR", help="results folder (resumable: rerun to continue)")
    add("--tasks", default="sst2,rte,boolq", help=f"comma-separated, from {', '.join(TASK_FILES)}")
    add("--methods", default=DEFAULT_METHODS, help=f"comma-separated, from {', '.join(METHODS)}")
    add(
        "--optimizers",
        default="sgd",
        help=f"comma-separated, from {', '.join(OPTIMIZERS)}: each mobizo method runs once with each (eager), "
        "same seed and batches; the table adds the steps each took to reach sgd's final validation accuracy",
    )
    add("--steps", type=int, default=2000, help="training steps of each method (paper: 20000)")
    add("--pilot-steps", type=int, default=200, help="steps of each learning-rate pilot")
    add("--eval-every", type=int, default=100, metavar="K", help="validation (and checkpoint) every K steps")
    add("--lr", action="append", default=[], metavar="METHOD=LR,LR", help="a method's learning-rate grid")
    add("--batch-size", type=int, default=16, help="examples per step (q·E)")
    add(
        "--lr-schedule",
        choices=SCHEDULES,
        help="lr over each run's --steps after warm-up (shared.schedule; a pilot is the opening of that run, "
        "continued as it is; default: the objective's, as a job's)",
    )
    add("--warmup-steps", type=int, default=defaults.WARMUP_STEPS, metavar="W", help="linear warm-up steps")
    add("--lr-floor", type=float, default=defaults.LR_FLOOR, metavar="F", help="decay's end, a fraction of lr")
    add("--rank", type=int, help="LoRA rank (default: the objective's, as a job's)")
    add("--alpha", type=float, help=f"LoRA alpha (default {defaults.SCALING:g} x rank)")
    add(
        "--targets",
        type=lambda text: tuple(t for t in text.split(",") if t),
        help="comma-separated LoRA target modules (default: the objective's, as a job's)",
    )
    add("--n-train", type=int, default=1000)
    add("--n-val", type=int, default=500)
    add("--n-test", type=int, default=1000)
    add(
        "--seq-len",
        type=int,
        help="cut prompts from the left to this many tokens (default: no cut; the program's "
        f"length with --runner program, default {defaults.SEQ_LEN})",
    )
    add(
        "--runner",
        choices=RUNNERS,
        default="eager",
        help="the training step: eager (shared.zo) or program (the device's ExecuTorch program, exported once into "
        f"OUT/programs; methods {', '.join(PROGRAM_METHODS)})",
    )
    add("--sample-seed", type=int, default=0, help="seeds the train/validation/test samples")
    add("--seed", type=int, default=defaults.SEED, help="run seed (batch order and step seeds)")
    add("--device", default="cpu", help="cpu or cuda")
    add("--dtype", default="float32")
    add("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    add("--data-dir", type=Path, help=f"task data (default: the shipped samples in data/, or ${TASK_DATA_ENV})")
    add("--chat-template", action="store_true", help="frame prompts with the model's chat template")
    add(
        "--prompt",
        choices=("model", "builtin"),
        default="model",
        help="read each task through its own prompt, not the one chosen for the model (MODEL/mobizo_prompts.json)",
    )
    add(
        "--objective",
        choices=OBJECTIVES,
        help="training loss (default: the task's, classification where its answers are single tokens; "
        "lm = cross-entropy over the whole vocabulary; use a fresh --out for each)",
    )
    add(
        "--quantize",
        choices=QUANTIZATIONS,
        default=defaults.QUANTIZE,
        help="the program's base linears (--runner program): 8da4w trains through the 8da4w program at a job's eps "
        "for it (shared.defaults.QUANTIZED_EPS); the adapter is scored on the float32 base, as a device's inference "
        "program runs it",
    )
    add("--no-plot", action="store_true", help="skip curves.png")
    return parser.parse_args(argv)


def lr_grids(args: argparse.Namespace) -> dict[str, tuple[float, ...]]:
    """Each method's grid: the default, or what ``--lr METHOD=a,b`` says."""
    grids = {name: m.lrs for name, m in METHODS.items() if m is not None}
    grids |= {name: METHODS[name.partition("+")[0]].lrs for name in getattr(args, "variants", [])}
    for item in args.lr:
        name, _, values = item.partition("=")
        if name not in grids or not values:
            raise SystemExit(f"--lr: expected METHOD=LR[,LR...] with METHOD in {', '.join(grids)}, got {item!r}")
        grids[name] = tuple(float(v) for v in values.split(","))
    return grids


# ---------------------------------------------------------------------------------------------------------------
# Data: seeded samples written once


def write_jsonl(path: Path, records: list[dict]) -> Path:
    return atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in records).encode())


def check_pools(data_dir: Path, tasks: list[str], args: argparse.Namespace) -> None:
    """Stop before any training when a task's pool is missing, or is one of the shipped samples and smaller than the
    draw (a folder the user names is used as it is: a smaller pool gives smaller train and validation sets)."""
    for task in tasks:
        pool_file = data_dir / TASK_FILES[task][0]
        if not pool_file.is_file():
            raise SystemExit(f"{task}: no {pool_file}; name the task data with --data-dir DIR or ${TASK_DATA_ENV}")
        with pool_file.open("rb") as handle:
            size = sum(1 for _ in handle)
        if data_dir.resolve() == SAMPLES_DIR and size < args.n_train + args.n_val:
            raise SystemExit(
                f"{task}: the shipped sample {pool_file} holds {size} examples, fewer than --n-train {args.n_train} + "
                f"--n-val {args.n_val}: name the full task data with --data-dir DIR or ${TASK_DATA_ENV} "
                "(or draw fewer)"
            )


def sample_task(task: str, data_dir: Path, out: Path, args: argparse.Namespace) -> dict[str, Path]:
    """``{train, val, test}`` files of a task's seeded sample (written once; the same seed gives the same files)."""
    folder = out / "data" / task
    files = {split: folder / f"{split}.jsonl" for split in ("train", "val", "test")}
    if all(p.is_file() for p in files.values()):
        return files
    pool_file, test_file = TASK_FILES[task]
    pool = read_jsonl(data_dir / pool_file)
    order = np.random.default_rng(args.sample_seed).permutation(len(pool))
    n_train, n_val = min(args.n_train, len(pool) // 2), min(args.n_val, len(pool) // 4)
    train_set = [pool[i] for i in order[:n_train]]
    val_set = [pool[i] for i in order[n_train : n_train + n_val]]
    test_set = read_jsonl(data_dir / test_file) if test_file else [pool[i] for i in order[n_train + n_val :]]
    for split, records in (("train", train_set), ("val", val_set), ("test", test_set[: args.n_test])):
        write_jsonl(files[split], records)
    return files


# ---------------------------------------------------------------------------------------------------------------
# Training runs (shared.train) and test evaluation


def run_config(
    args: argparse.Namespace, task: str, files: dict[str, Path], method: Method, lr: float, out: Path, steps: int
) -> TrainConfig:
    return TrainConfig(
        model=args.model,
        task=task,
        train=files["train"],
        eval=files["val"],
        out=out,
        method=method.method,
        q=method.q,
        batch_size=args.batch_size,
        steps=steps,
        schedule_steps=args.steps,  # a pilot is the opening of the whole run: the same lr at every step
        lr=lr,
        lr_schedule=args.lr_schedule,
        warmup_steps=args.warmup_steps,
        lr_floor=args.lr_floor,
        eps=defaults.QUANTIZED_EPS.get(args.quantize, method.eps),  # a quantized base: a job's eps for it
        optimizer=method.optimizer,
        seed=args.seed,
        dtype=args.dtype,
        device=args.device,
        seq_len=args.seq_len,
        rank=args.rank,
        alpha=args.alpha,
        targets=args.targets,
        eval_every=args.eval_every,
        checkpoint_every=None if method.method == "mezo" else args.eval_every,
        chat_template=args.chat_template,
        prompt=args.prompt,
        objective=args.objective,
    )


def finished(out: Path, steps: int) -> dict[str, Any] | None:
    """The metrics of a run in ``out`` that finished ``steps`` steps, else None."""
    path = out / METRICS_FILE
    if path.is_file():
        metrics = json.loads(path.read_text())
        if metrics["steps"] == steps:
            return metrics
    return None


def train_once(config: TrainConfig, step_factory: StepFactory | None = None) -> dict[str, Any]:
    """Train (resuming from a checkpoint) unless a finished run is there; prints one line per run."""
    done = finished(Path(config.out), config.steps)
    if done is not None:
        return done
    begin = time.perf_counter()
    metrics = train(config, progress=False, step_factory=step_factory)
    print(f"  {config.out}: {config.steps} steps in {time.perf_counter() - begin:.0f} s", file=sys.stderr, flush=True)
    return metrics


def pick_lr(
    args: argparse.Namespace, task: str, files: dict[str, Path], name: str, grid: tuple[float, ...], base: Path
) -> tuple[float, list[dict]]:
    """The grid's learning rate whose pilot ends with the lowest validation loss, and every pilot's summary."""
    method = method_of(name)
    steps = min(args.pilot_steps, args.steps)
    pilots = []
    for lr in grid:
        config = run_config(args, task, files, method, lr, base / f"pilot-lr{lr:g}", steps)
        metrics = train_once(config, program_steps(args, config))
        pilots.append({"lr": lr, "steps": steps, "eval": metrics["eval"]})
    best = min(pilots, key=lambda p: p["eval"][-1]["loss"])
    return best["lr"], pilots


def train_method(
    args: argparse.Namespace, task: str, files: dict[str, Path], name: str, grid: tuple[float, ...]
) -> dict[str, Any]:
    """Pilots, then the winning pilot continued to ``--steps``; returns the run's summary (no test yet)."""
    method = method_of(name)
    base = args.out / "runs" / task / (name if args.runner == "eager" else f"{name}-program")
    if args.quantize != defaults.QUANTIZE:
        base = base.with_name(f"{base.name}-{args.quantize}")
    if len(grid) == 1:
        lr, pilots = grid[0], []
    else:
        lr, pilots = pick_lr(args, task, files, name, grid, base)
    main = base / "main"
    pilot = base / f"pilot-lr{lr:g}" / CHECKPOINT_DIR
    if pilots and not (main / CHECKPOINT_DIR).exists() and pilot.is_dir():
        with atomic_dir(main / CHECKPOINT_DIR) as tmp:  # continue the winning pilot; a kill mid-copy leaves none
            shutil.copytree(pilot, tmp, dirs_exist_ok=True)
    config = run_config(args, task, files, method, lr, main, args.steps)
    metrics = train_once(config, program_steps(args, config))
    return {"lr": lr, "pilots": pilots, "metrics": metrics, "out": main}


def program_steps(args: argparse.Namespace, config: TrainConfig) -> StepFactory | None:
    """With ``--runner program``: the run's step taken by its exported program in the ExecuTorch runtime (exported
    on first use into ``OUT/programs/<key>``, reused by every run of that configuration)."""
    if args.runner == "eager":
        return None

    def make(program, lora):
        from benchmarks.program_steps import FirstOrderStep, ProgramStep
        from shared.manifest import FIRST_ORDER, read_training_manifest

        program = program.model_copy(update={"quantize": args.quantize})
        # fo-lora: ExecuTorch's own first-order training (shared.fo_program)
        kind = FIRST_ORDER if config.method == "fo-lora" else ZEROTH_ORDER
        pte = exported_program(args.model, program, args.out / "programs", kind)
        manifest = read_training_manifest(pte)
        if manifest.lora_size != lora.size:
            raise SystemExit(f"{pte}: B of {manifest.lora_size} floats, the run's LoRA has {lora.size}")
        if kind == FIRST_ORDER:
            return FirstOrderStep(pte, pte.parent / manifest.ptd.file, manifest)
        return ProgramStep(pte, pte.parent / manifest.ptd.file, config.eps, manifest)

    return make


def program_entry(model: Path, program, folder: Path, kind: str = ZEROTH_ORDER) -> Path:
    """The folder in ``folder`` that holds the export of ``program`` (a ``ProgramConfig``) for ``model``: the
    device's step (``shared.program``), or with ``kind`` ``first-order`` the peer's (``shared.fo_program``)."""
    import hashlib

    from shared.manifest import FORMAT_VERSION
    from shared.model_files import model_sha256

    blob = {"model": model_sha256(model), "config": program.model_dump(mode="json"), "v": FORMAT_VERSION}
    if kind != ZEROTH_ORDER:  # the keys of earlier exports stay what they were
        blob["kind"] = kind
    return folder / hashlib.sha256(json.dumps(blob).encode()).hexdigest()[:16]


def exported_program(model: Path, program, folder: Path, kind: str = ZEROTH_ORDER) -> Path:
    """The ``.pte`` of ``program`` (a ``ProgramConfig``) for ``model`` in ``folder`` (of ``kind``, as
    ``program_entry``), exported there the first time (atomically: a killed export leaves nothing) → its path.
    Prints the export's seconds."""
    from shared.files import publish_once
    from shared.fo_program import export_first_order
    from shared.program import export_program

    entry = program_entry(model, program, folder, kind)
    export = export_program if kind == ZEROTH_ORDER else export_first_order
    if not (entry / "program.pte").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        begin = time.perf_counter()
        say = partial(print, file=sys.stderr, flush=True)
        publish_once(entry, lambda tmp: export(model, program, tmp / "program.pte", tmp, progress=say))
        atomic_write_bytes(entry / "export_s.txt", f"{time.perf_counter() - begin:.1f}\n".encode())
        say(f"  exported {entry} in {time.perf_counter() - begin:.0f} s")
    return entry / "program.pte"


class Scorer:
    """One task's model, with LoRA injected (idle for zero-shot), to score the validation and test files."""

    def __init__(self, args: argparse.Namespace, task: str) -> None:
        self.model, self.tokenizer = load_model(args.model, args.dtype, args.device)
        self.lora = inject_lora(self.model, args.targets, args.rank, args.alpha, defaults.A_SEED)
        template, verbalizer, chat = resolve_prompt(args.model, task, None, None, args.chat_template, args.prompt)
        frame = model_chat_frame(args.model) if chat else None
        self.task, self.seq_len = with_chat(get_task(task, template, verbalizer), frame), args.seq_len

    def score(self, path: Path, b: torch.Tensor | None = None) -> dict[str, Any]:
        self.lora.apply(None if b is None else b.to(self.lora.device)[None])
        try:
            return evaluate(self.model, self.tokenizer, self.task, load_examples(self.task, path), max_len=self.seq_len)
        finally:
            self.lora.apply(None)


def cached(path: Path, compute) -> dict[str, Any]:
    """``compute()``'s JSON result, stored in ``path`` the first time."""
    if path.is_file():
        return json.loads(path.read_text())
    result = compute()
    atomic_write_bytes(path, (json.dumps(result, indent=2) + "\n").encode())
    return result


def test_result(
    args: argparse.Namespace, scorer: Scorer, files: dict[str, Path], run: dict[str, Any]
) -> dict[str, Any]:
    """Test accuracy of the adapter at the best validation step (``mezo``: at the end, it has no checkpoint)."""
    metrics = run["metrics"]
    checkpoint = load_checkpoint(run["out"])
    if checkpoint is None:  # mezo: the final model is gone with its process; only its curve is reported
        return {"best_step": None, "val_accuracy": metrics["eval"][-1]["accuracy"], "test": None}
    best = checkpoint.best
    result_file = run["out"] / f"test-{metrics['steps']}.json"
    test = cached(result_file, partial(scorer.score, files["test"], checkpoint.best_b))
    return {"best_step": best["step"], "val_accuracy": best["accuracy"], "test": test}


# ---------------------------------------------------------------------------------------------------------------
# The benchmark


def run_task(args: argparse.Namespace, task: str, methods: list[str], grids: dict) -> dict[str, Any]:
    files = sample_task(task, args.data_dir, args.out, args)
    rows: dict[str, Any] = {}
    scorer = None
    for name in methods:
        print(f"{task} / {name}", file=sys.stderr, flush=True)
        if name == "zero-shot":
            scorer = scorer or Scorer(args, task)
            folder = args.out / "runs" / task / "zero-shot"
            val = cached(folder / "val.json", partial(scorer.score, files["val"]))
            test = cached(folder / "test.json", partial(scorer.score, files["test"]))
            rows[name] = {"val_accuracy": val["accuracy"], "test": test, "curve": [{"step": 0, **val}]}
            continue
        run = train_method(args, task, files, name, grids[name])
        scorer = scorer or Scorer(args, task)
        metrics = run["metrics"]
        rows[name] = test_result(args, scorer, files, run) | {
            "lr": run["lr"],
            "pilots": run["pilots"],
            "steps": metrics["steps"],
            "curve": metrics["eval"],
            "step_time_s": metrics["step_time_s"],
            "train_time_s": metrics["train_time_s"],
        }
    return rows


def steps_to_reach(curve: list[dict], accuracy: float) -> int | None:
    """The first evaluated step whose validation accuracy is at least ``accuracy`` (None: never)."""
    return next((e["step"] for e in curve if e["accuracy"] is not None and e["accuracy"] >= accuracy), None)


def reach_table(results: dict[str, Any]) -> str:
    """Per mobizo method with more than one optimizer: the steps each optimizer took to reach the validation
    accuracy ``sgd`` ended with (the issue's measure: fewer steps to the same accuracy)."""
    lines = []
    for task, rows in results["tasks"].items():
        for name, row in rows.items():
            variants = {n: r for n, r in rows.items() if n.partition("+")[0] == name}
            if "+" in name or len(variants) < 2:
                continue
            target = row["curve"][-1]["accuracy"]
            for variant, r in variants.items():
                reached = steps_to_reach(r["curve"], target)
                ratio = "—" if not reached else f"{row['steps'] / reached:.2f}x"
                lines.append(f"{task:<6} {variant:<22} reaches {target:.3f} at step {reached!s:>5}  ({ratio} of sgd's)")
    return "\n".join(lines)


def table(results: dict[str, Any]) -> str:
    head = f"{'task':<6} {'method':<22} {'lr':>8} {'steps':>6} {'best':>6} {'val acc':>8} {'test acc':>8} {'s/step':>7}"
    lines = [head, "-" * len(head)]
    for task, rows in results["tasks"].items():
        for name, row in rows.items():
            test = "—" if row["test"] is None else f"{row['test']['accuracy']:.3f}"
            lr = f"{row['lr']:g}" if "lr" in row else "—"
            steps = row.get("steps", 0)
            best = "—" if row.get("best_step") is None else row["best_step"]
            step_time = f"{row['step_time_s']:.2f}" if "step_time_s" in row else "—"
            val = f"{row['val_accuracy']:.3f}"
            lines.append(f"{task:<6} {name:<22} {lr:>8} {steps:>6} {best!s:>6} {val:>8} {test:>8} {step_time:>7}")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    """Validation accuracy and loss against steps, one column per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = results["tasks"]
    fig, axes = plt.subplots(2, len(tasks), figsize=(5 * len(tasks), 7), squeeze=False)
    for col, (task, rows) in enumerate(tasks.items()):
        for name, row in rows.items():
            steps = [e["step"] for e in row["curve"]]
            for ax, key in ((axes[0][col], "accuracy"), (axes[1][col], "loss")):
                if name == "zero-shot":
                    ax.axhline(row["curve"][0][key], color="grey", linestyle="--", label=name)
                else:
                    ax.plot(steps, [e[key] for e in row["curve"]], marker=".", label=f"{name} (lr {row['lr']:g})")
        axes[0][col].set_title(f"{task}: validation accuracy")
        axes[1][col].set_title(f"{task}: validation loss (nats)")
        axes[1][col].set_xlabel("step")
        axes[0][col].legend(fontsize=8)
    how = "eager training" if results.get("runner", "eager") == "eager" else "training through the device program"
    if results.get("quantize", defaults.QUANTIZE) != defaults.QUANTIZE:
        how += f" ({results['quantize']} base)"
    title = f"{Path(results['model']).name}: batch {results['batch_size']}, {how} ({results['device']})"
    fig.suptitle(textwrap.fill(title, 50 * len(tasks)), fontsize=10)  # about what a column's width holds
    fig.tight_layout()
    atomic_write(path, lambda handle: fig.savefig(handle, format="png", dpi=100))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tasks, methods, optimizers = args.tasks.split(","), args.methods.split(","), args.optimizers.split(",")
    unknown = [t for t in tasks if t not in TASK_FILES] + [m for m in methods if m not in METHODS]
    unknown += [o for o in optimizers if o not in OPTIMIZERS]
    if unknown:
        raise SystemExit(f"unknown task, method or optimizer: {', '.join(unknown)}")
    methods = with_optimizers(methods, optimizers)
    args.variants = [m for m in methods if "+" in m]
    grids = lr_grids(args)
    # The tasks here all have single-token answers: their objective is classification unless --objective says lm.
    chosen = defaults.for_method(defaults.METHOD, objective=args.objective or "classification")
    args.rank = args.rank or chosen.rank
    args.alpha = args.alpha or defaults.alpha_for(args.rank)
    args.targets = args.targets or defaults.TARGETS
    args.lr_schedule = args.lr_schedule or chosen.lr_schedule
    if args.runner == "program":
        off = [m for m in methods if m.partition("+")[0] not in PROGRAM_METHODS]
        if off:
            raise SystemExit(
                f"--runner program: {', '.join(off)} has no device program (use {', '.join(PROGRAM_METHODS)})"
            )
        if args.device != "cpu" or args.dtype != "float32":
            raise SystemExit("--runner program: the program runs float32 on the CPU (--device cpu --dtype float32)")
        args.seq_len = args.seq_len or defaults.SEQ_LEN
    elif args.quantize != defaults.QUANTIZE:
        raise SystemExit(f"--quantize {args.quantize}: a quantized base is a program's (add --runner program)")
    args.data_dir = args.data_dir or task_data_dir()
    check_pools(args.data_dir, tasks, args)
    results = {
        "model": str(args.model),
        "device": args.device,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "training": "eager (shared.train)" if args.runner == "eager" else "program (ExecuTorch runtime)",
        "runner": args.runner,
        "quantize": args.quantize,
        "lr_schedule": {"shape": args.lr_schedule, "warmup_steps": args.warmup_steps, "floor": args.lr_floor},
        "chat_template": args.chat_template,
        "tasks": {task: run_task(args, task, methods, grids) for task in tasks},
    }
    atomic_write_bytes(args.out / "results.json", (json.dumps(results, indent=2) + "\n").encode())
    if not args.no_plot:
        plot(results, args.out / "curves.png")
    print(table(results))
    reached = reach_table(results)
    if reached:
        print(reached)
    return 0


if __name__ == "__main__":
    sys.exit(main())
