"""Which hyperparameters around a job's defaults learn faster? Named variants of the defaults, each over run seeds.

The accuracy benchmark (``benchmarks/accuracy.py``) tunes one method's learning rate at a time; this script asks whether
anything NEAR a job's defaults (what ``mobizo train`` takes when told nothing: for a classification task MobiZO q = 4 at
batch 16 in length buckets of 8, rank 4 on q_proj and v_proj, lr 2e-2 with a cosine decay to 0, eps 1e-2, 200 steps,
``shared.defaults``, read through the model's chosen prompt, ``shared.prompts``) gains more, averaged over run seeds
(batch order and step seeds), because one seed's figure moves by several points. Each variant changes a few ``mobizo
train`` settings (``VARIANTS``); every run is ``shared.train.train`` on the accuracy benchmark's seeded sample of the
task (``benchmarks.accuracy.sample_task``: 1,000 training examples, and the test set), scored on the test set every
``--eval-every`` steps. Its step is the eager one, or with ``--runner program`` the device's ExecuTorch program
(exported once per configuration into ``OUT/programs``; a ``fo-lora`` variant's is ExecuTorch's own first-order
training program of the same adapter, ``shared.fo_program``). The first table gives the test accuracy of each seed's
LAST step (the adapter a job returns, with no step chosen by a held-out set), the mean over seeds and its gain over the
base model (step 0), and the mean at the middle of the run; the second speaks in device-seconds (steps x the run's
median step time: run it alone on the machine): each variant's step time and the mean accuracy within ``--budget``
seconds, at the last step and at each seed's best. ``OUT/last-step.png`` draws the last-step figures,
``OUT/device-seconds.png`` each variant's mean accuracy against device-seconds.

Runs go ``--workers`` at a time, each a process (``--threads`` torch threads each; on a GPU several processes keep
it busier than one). A run's result is a file of ``OUT/results/``, written when it finishes; runs checkpoint
every ``--eval-every`` steps (or ``--checkpoint-every``), so the same command, started again, skips the finished
runs and continues the others.
``--deadline S`` stops once a run finishes past S seconds: the runs still going are stopped (the same command
continues them from their checkpoints), and the table holds the runs that finished.

    python -m benchmarks.sweep --model DIR --data-dir DATA --device cuda --workers 8 --out runs/sweep
    python -m benchmarks.sweep --model DIR --data-dir DATA --variants defaults,earlier-defaults --seeds 0 --out runs/sw
    python -m benchmarks.sweep --model DIR --data-dir DATA --runner program --variants defaults,calibrated \
        --eval-every 100 --threads 2 --out runs/sweep-program
    python -m benchmarks.sweep --model DIR --data-dir DATA --variants defaults,fo-lora-lr-1.6e-1 --steps 20000 \
        --equal-forwards --eval-every 1000 --device cuda --workers 6 --out runs/sweep-night   # a night's horizon
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.accuracy import TASK_FILES, check_pools, program_steps, sample_task
from shared import defaults
from shared.files import atomic_write, atomic_write_bytes
from shared.tasks import task_data_dir

# A job's defaults: every variant starts from what ``mobizo train`` takes when it is told nothing (shared.defaults;
# the model's chosen prompt, shared.prompts), so the ``defaults`` row is what a user gets.
BASE: dict[str, Any] = {}
# The earlier defaults, which the variants of docs/benchmarks/sweep.md's second section change: the built-in prompt,
# lr 4e-2, batches as drawn.
EARLIER: dict[str, Any] = {"prompt": "builtin", "lr": 4e-2, "bucket": 1}
VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    # learning per device-second, on the model's chosen prompt: the lr and length buckets, calibration (Zhao et al.),
    # probes per step with the lr scaled in proportion (MeZO, App. A)
    "calibrated": {"calibrate": True},
    "lr-4e-2-bucket-1": {"lr": 4e-2, "bucket": 1},
    "calibrated-lr-4e-2-bucket-1": {"calibrate": True, "lr": 4e-2, "bucket": 1},
    "bucket-1": {"bucket": 1},
    "calibrated-bucket-1": {"calibrate": True, "bucket": 1},
    "q-8-lr-4e-2": {"q": 8, "lr": 4e-2},
    "q-16-lr-8e-2": {"q": 16, "lr": 8e-2},
    "curvature": {"probe_weights": "curvature"},  # 1.5-SPSA's probe weights: a clean path per query, 1.5x the paths
    # a night's peak lr: the 2,800-step run's sum of squared lrs (the directions' random walk) spread over 20,000 steps,
    # 2e-2 x sqrt(2,800 / 20,000) (docs/benchmarks/sweep.md, "A night")
    "lr-7.5e-3": {"lr": 7.5e-3},
    # the reference: first-order LoRA-FA on the same coordinates and prompt (with --runner program, ExecuTorch's own
    # training runtime: shared.fo_program)
    "fo-lora-lr-1.6e-1": {"method": "fo-lora", "lr": 1.6e-1, "rank": 4, "lr_schedule": "cosine"},
    "fo-lora-rank-16-constant": {"method": "fo-lora", "lr": 1.6e-1},  # fo-lora's own rank and schedule
    # around the earlier defaults (built-in prompt, lr 4e-2, no buckets)
    "earlier-defaults": EARLIER,
    **{
        name: {**EARLIER, **settings}
        for name, settings in {
            "lr-6e-2": {"lr": 6e-2},
            "lr-3e-2": {"lr": 3e-2},
            "eps-1e-3": {"eps": 1e-3},
            "warmup-20-lr-6e-2": {"warmup_steps": 20, "lr": 6e-2},
            "rank-2-lr-6e-2": {"rank": 2, "lr": 6e-2},
            "rank-2-lr-8e-2": {"rank": 2, "lr": 8e-2},
            "rank-1-lr-8e-2": {"rank": 1, "lr": 8e-2},
            "rank-1-lr-1.6e-1": {"rank": 1, "lr": 1.6e-1},
            "v-only-lr-6e-2": {"targets": ("v_proj",), "lr": 6e-2},
            "q-8": {"q": 8},
            "q-16-lr-3e-2": {"q": 16, "lr": 3e-2},
            "batch-32": {"batch_size": 32},
            "batch-32-q-16": {"batch_size": 32, "q": 16},
            "momentum-lr-2e-2": {"optimizer": "momentum", "lr": 2e-2},
            "normalized-lr-3e-2": {"optimizer": "normalized", "lr": 3e-2},
            "long-lr-2e-2": {"steps": 2000, "lr": 2e-2},
        }.items()
    },
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--model", required=True, type=Path, metavar="DIR", help="Hugging Face model folder")
    add("--out", required=True, type=Path, metavar="DIR", help="results folder (resumable: rerun to continue)")
    add("--task", default="sst2", choices=TASK_FILES)
    add("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {', '.join(VARIANTS)}")
    add("--seeds", default="0,1,2", help="comma-separated run seeds")
    add("--steps", type=int, default=200, help="steps of a variant that names none")
    add(
        "--equal-forwards",
        action="store_true",
        help="a first-order variant that names no steps takes 2/3 of --steps: the forward passes of the zeroth-order "
        "runs (a MobiZO step is two forwards of its batch, a first-order step about three)",
    )
    add(
        "--eval-every",
        type=int,
        default=50,
        metavar="K",
        help="test accuracy (and checkpoint, unless --checkpoint-every) every K steps",
    )
    add("--checkpoint-every", type=int, metavar="K", help="checkpoint every K steps (default: --eval-every)")
    add("--n-train", type=int, default=1000)
    add("--n-val", type=int, default=500, help="held back from the training pool (as the accuracy benchmark's)")
    add("--n-test", type=int, default=1000)
    add("--sample-seed", type=int, default=0, help="seeds the train/test samples")
    add("--seq-len", type=int, help="cut prompts from the left to this many tokens (default: no cut)")
    add("--data-dir", type=Path, help="task data (default: the shipped samples in data/, or $MOBIZO_TASK_DATA_DIR)")
    add(
        "--runner",
        choices=("eager", "program"),
        default="eager",
        help="the step: eager (shared.train) or program (the device's ExecuTorch program, exported once per "
        "configuration into OUT/programs: device-seconds are a device's)",
    )
    add("--budget", type=float, default=300.0, metavar="S", help="the table's device-seconds column (default 300)")
    add("--device", default="cpu", help="cpu or cuda")
    add("--workers", type=int, default=1, help="runs at a time, each in its own process (1: in this process)")
    add("--threads", type=int, default=1, help="torch CPU threads of each run")
    add("--deadline", type=float, metavar="S", help="stop once a run ends past S seconds (a rerun resumes the rest)")
    add("--no-plot", action="store_true", help="skip OUT/last-step.png")
    args = parser.parse_args(argv)
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)} (choose from {', '.join(VARIANTS)})")
    return args


def equal_forward_steps(zo_steps: int) -> int:
    """First-order steps that cost the forward passes of ``zo_steps`` MobiZO steps: a MobiZO step runs 2q copies of
    E = batch/q rows each (two forwards of its batch), a first-order step a forward and a backward of the batch
    (about three forwards)."""
    return math.ceil(2 * zo_steps / 3)


def variant_settings(job: dict[str, Any]) -> dict[str, Any]:
    """The ``mobizo train`` settings of a run: the variant's over a job's defaults, its steps ``job["steps"]`` where it
    names none (a first-order variant's at the same forward passes where ``job["equal_forwards"]``)."""
    settings = {**BASE, **VARIANTS[job["variant"]]}
    first_order = settings.get("method") == "fo-lora" and job.get("equal_forwards", False)
    settings.setdefault("steps", equal_forward_steps(job["steps"]) if first_order else job["steps"])
    return settings


def run_one(job: dict[str, Any]) -> dict[str, Any]:
    """Train one (variant, seed) and return its result line; in a worker process or in this one."""
    import torch

    from shared.train import TrainConfig, train, with_defaults

    torch.set_num_threads(job["threads"])
    settings = variant_settings(job)
    program = job["runner"] == "program"
    config = TrainConfig(
        model=job["model"],
        task=job["task"],
        train=Path(job["files"]["train"]),
        eval=Path(job["files"]["test"]),
        out=Path(job["out"]),
        seed=job["seed"],
        eval_every=job["eval_every"],
        checkpoint_every=job.get("checkpoint_every") or job["eval_every"],
        seq_len=job["seq_len"] or (defaults.SEQ_LEN if program else None),
        device=job["device"],
        **settings,
    )
    factory = None
    if program:  # the step of the device's program, exported once per configuration into OUT/programs
        where = argparse.Namespace(runner="program", model=Path(job["model"]), quantize="none", out=Path(job["root"]))
        factory = program_steps(where, with_defaults(config))  # the step's eps: the run's, defaults resolved
    begin = time.perf_counter()
    metrics = train(config, progress=False, step_factory=factory)
    step_s = metrics["step_time_s"]
    return {
        "variant": job["variant"],
        "seed": job["seed"],
        "steps": metrics["steps"],
        "q": metrics["q"],
        "batch_size": metrics["batch_size"],
        "runner": job["runner"],
        # device-seconds: steps x the run's median step time (the step alone: no evaluation, no batch building)
        "curve": [
            {"step": e["step"], "accuracy": e["accuracy"], "device_s": e["step"] * step_s} for e in metrics["eval"]
        ],
        "step_time_s": step_s,
        "wall_s": time.perf_counter() - begin,
        "device": metrics["device"],
    }


def read_results(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))]


def at_budget(run: dict[str, Any], budget: float) -> float:
    """A run's test accuracy at its last evaluation within ``budget`` device-seconds (step 0 if none)."""
    return [p for p in run["curve"] if p.get("device_s", 0.0) <= budget][-1]["accuracy"]


def budget_table(results: list[dict[str, Any]], variants: list[str], budget: float) -> str:
    """One row per variant, in device-seconds: its step's median seconds, the mean over seeds of the test accuracy
    at the budget, at the last step and at each seed's best evaluation, and the gain over step 0 at the budget."""
    at = f"at {budget:g} s"
    head = f"{'variant':<34} {'s/step':>7} {'steps':>6} {at:>9} {'gain':>6} {'last':>6} {'best':>6} {'seeds':>5}"
    lines = [head, "-" * len(head)]
    for variant in variants:
        runs = [r for r in results if r["variant"] == variant]
        if not runs:
            continue
        step_s = statistics.mean(r["step_time_s"] for r in runs)
        within = statistics.mean(at_budget(r, budget) for r in runs)
        base = statistics.mean(r["curve"][0]["accuracy"] for r in runs)
        last = statistics.mean(r["curve"][-1]["accuracy"] for r in runs)
        best = statistics.mean(max(p["accuracy"] for p in r["curve"]) for r in runs)
        lines.append(
            f"{variant:<34} {step_s:>7.3f} {runs[0]['steps']:>6} {within:>9.3f} {100 * (within - base):>+6.1f} "
            f"{last:>6.3f} {best:>6.3f} {len(runs):>5}"
        )
    return "\n".join(lines)


def plot_device_seconds(results: list[dict[str, Any]], variants: list[str], path: Path, budget: float) -> None:
    """Test accuracy against device-seconds: each variant's mean over its seeds at every evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for variant in variants:
        runs = [r for r in results if r["variant"] == variant]
        if not runs:
            continue
        points = min(len(r["curve"]) for r in runs)
        xs = [statistics.mean(r["curve"][i].get("device_s", 0.0) for r in runs) for i in range(points)]
        ys = [statistics.mean(r["curve"][i]["accuracy"] for r in runs) for i in range(points)]
        ax.plot(xs, ys, marker=".", label=f"{variant} ({len(runs)} seeds)")
    ax.axvline(budget, color="grey", linestyle=":", label=f"{budget:g} device-seconds")
    ax.set_xlabel("device-seconds (steps x the step's median seconds)")
    ax.set_ylabel("test accuracy (mean over run seeds)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_write(path, lambda handle: fig.savefig(handle, format="png", dpi=100))


def table(results: list[dict[str, Any]], variants: list[str]) -> str:
    """One row per variant: each seed's test accuracy at the last step, their mean and its gain over step 0, and the
    mean at the middle of the run (the eval step nearest half of it)."""
    head = f"{'variant':<34} {'settings':<44} {'last step, per seed':<22} {'mean':>6} {'gain':>6} {'mid':>12}"
    lines = [head, "-" * len(head)]
    for variant in variants:
        runs = sorted((r for r in results if r["variant"] == variant), key=lambda r: r["seed"])
        if not runs:
            continue
        last = [r["curve"][-1]["accuracy"] for r in runs]
        base = statistics.mean(r["curve"][0]["accuracy"] for r in runs)
        mid_step = min((p["step"] for p in runs[0]["curve"]), key=lambda s: abs(s - runs[0]["steps"] / 2))
        mid = statistics.mean(p["accuracy"] for r in runs for p in r["curve"] if p["step"] == mid_step)
        settings = ", ".join(f"{k} {'/'.join(v) if isinstance(v, tuple) else v}" for k, v in VARIANTS[variant].items())
        per_seed = " ".join(f"{a:.3f}" for a in last)
        mean = statistics.mean(last)
        lines.append(
            f"{variant:<34} {settings or '(a job’s defaults)':<44} {per_seed:<22} {mean:>6.3f} "
            f"{100 * (mean - base):>+6.1f} {f'{mid:.3f} @{mid_step}':>12}"
        )
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], variants: list[str], path: Path) -> None:
    """Each variant's last-step test accuracy per seed (dots) and their mean (a bar), best mean on top, beside the
    defaults' mean and the base model's accuracy + 25 points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    for variant in variants:
        runs = [r for r in results if r["variant"] == variant]
        if runs:
            last = [r["curve"][-1]["accuracy"] for r in runs]
            label = variant if runs[0]["steps"] == 200 else f"{variant} ({runs[0]['steps']:,} steps)"
            rows.append((statistics.mean(last), label, last, runs[0]["curve"][0]["accuracy"]))
    rows.sort()
    fig, ax = plt.subplots(figsize=(8, 0.32 * len(rows) + 1.4))
    for y, (mean, label, last, _) in enumerate(rows):
        ax.barh(y, mean, color="tab:blue" if label != "defaults" else "tab:orange", alpha=0.35)
        ax.plot(last, [y] * len(last), "k.", markersize=6)
    base = statistics.mean(r[3] for r in rows)
    ax.axvline(base + 0.25, color="tab:red", linestyle="--", label=f"base model + 25 points ({base + 0.25:.3f})")
    for mean, label, _, _ in rows:
        if label == "defaults":
            ax.axvline(mean, color="tab:orange", label=f"the defaults' mean ({mean:.3f})")
    ax.set_yticks(range(len(rows)), [r[1] for r in rows], fontsize=8)
    ax.set_xlim(base, max(max(r[2]) for r in rows) + 0.04)
    ax.set_xlabel(f"test accuracy at the last step (dots: run seeds; bars: their mean; base model {base:.3f})")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    atomic_write(path, lambda handle: fig.savefig(handle, format="png", dpi=100))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    data_dir = args.data_dir or task_data_dir()
    check_pools(data_dir, [args.task], args)
    files = sample_task(args.task, data_dir, args.out, args)
    variants, seeds = args.variants.split(","), [int(s) for s in args.seeds.split(",")]
    results_dir = args.out / "results"
    done = {(r["variant"], r["seed"]) for r in read_results(results_dir)}
    common = {
        "model": str(args.model),
        "task": args.task,
        "files": {k: str(v) for k, v in files.items()},
        "steps": args.steps,
        "equal_forwards": args.equal_forwards,
        "eval_every": args.eval_every,
        "checkpoint_every": args.checkpoint_every,
        "seq_len": args.seq_len,
        "device": args.device,
        "threads": args.threads,
        "runner": args.runner,
        "root": str(args.out),
    }
    jobs = [
        common | {"variant": v, "seed": s, "out": str(args.out / "runs" / f"{v}-seed{s}")}
        for v in variants
        for s in seeds
        if (v, s) not in done
    ]
    print(f"{len(jobs)} runs to go ({len(done)} finished before)", file=sys.stderr, flush=True)
    begin = time.perf_counter()
    pool = multiprocessing.get_context("spawn").Pool(args.workers) if args.workers > 1 else None
    try:
        for result in pool.imap_unordered(run_one, jobs) if pool else map(run_one, jobs):
            name = f"{result['variant']}-seed{result['seed']}.json"
            atomic_write_bytes(results_dir / name, (json.dumps(result, indent=2) + "\n").encode())
            curve = " ".join(f"{p['accuracy']:.3f}" for p in result["curve"])
            print(f"  {result['variant']} seed {result['seed']}: {curve}", file=sys.stderr, flush=True)
            if args.deadline is not None and time.perf_counter() - begin > args.deadline:
                print("deadline: no more runs started", file=sys.stderr)
                break
    finally:
        if pool:
            pool.terminate()
    results = read_results(results_dir)
    if not args.no_plot and results:
        plot(results, variants, args.out / "last-step.png")
        plot_device_seconds(results, variants, args.out / "device-seconds.png", args.budget)
    print(table(results, variants))
    print()
    print(budget_table(results, variants, args.budget))
    return 0


if __name__ == "__main__":
    sys.exit(main())
