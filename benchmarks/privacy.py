"""How much accuracy does privacy cost? One job at epsilon = inf, 8, 3 and 1 (delta 1e-5), side by side.

For each epsilon, ``mobizo train`` (``shared.train.train``, eager, MobiZO with the defaults of the task's objective
unless given) trains on the first ``--n-train`` SST-2 training rows of the shipped sample, privately for a finite
epsilon (``shared.privacy``: clipped, noised g; batches sampled without replacement), and the held-out accuracy of
its final B is measured on the first ``--n-eval`` validation rows. Printed: epsilon, the noise multiplier sigma and
the noise's standard deviation on each g, accuracy before and after, and the median step time. Runs are resumable:
a finished run's ``metrics.json`` under ``--out`` is read back instead of trained again.

``--clip-only`` adds a diagnostic row (``clip``, not private): the private path with its noise removed (sigma 0),
so that what clipping and the private sampling cost is told apart from what the noise costs. ``--seed`` seeds the
non-private runs (a private run draws its own seed, which stays on the device).

    python -m benchmarks.privacy --model runs/smollm2 --steps 200 --n-train 1000 --n-eval 200 --out runs/privacy
    python -m benchmarks.privacy --steps 20 --n-train 64 --n-eval 32 --out runs/privacy-tiny   # the tiny model
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path
from typing import Any

from shared import defaults

EPSILONS = (math.inf, 8.0, 3.0, 1.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="Hugging Face model folder (default: a fresh tiny model)")
    parser.add_argument("--out", type=Path, required=True, help="runs, data slices and results.json go here")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--n-train", type=int, default=1000, help="training rows (the private sampling pool)")
    parser.add_argument("--n-eval", type=int, default=200, help="validation rows")
    parser.add_argument("--epsilons", type=float, nargs="+", default=list(EPSILONS), help="inf: not private")
    parser.add_argument("--delta", type=float, default=defaults.DP_DELTA)
    parser.add_argument("--clip", type=float, default=defaults.DP_CLIP, help="C (default: a private job's)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--q", type=int, default=1, help="queries per step (the figures in the docs: 1)")
    parser.add_argument("--lr", type=float, help="default: the objective's")
    parser.add_argument("--clip-only", action="store_true", help="add the private path without its noise (sigma 0)")
    parser.add_argument("--seed", type=int, default=0, help="the non-private runs' seed")
    return parser.parse_args(argv)


def _slice(source: Path, rows: int, out: Path) -> Path:
    from shared.files import atomic_write_bytes

    if not out.is_file():
        with open(source) as f:
            atomic_write_bytes(out, "".join(itertools.islice(f, rows)).encode())
    return out


def run_one(
    args: argparse.Namespace, model: Path, files: dict[str, Path], epsilon: float, clip_only: bool = False
) -> dict[str, Any]:
    """One run: not private at epsilon inf, else private at (epsilon, ``--delta``, ``--clip``); ``clip_only``: the
    private path with sigma 0 (its noise removed and nothing spent counted: a diagnostic, not a private run)."""
    from unittest import mock

    from shared import privacy
    from shared.train import TrainConfig, train

    name = "clip-only" if clip_only else "eps-inf" if math.isinf(epsilon) else f"eps-{epsilon:g}"
    out = args.out / (f"{name}-seed{args.seed}" if args.seed and math.isinf(epsilon) and not clip_only else name)
    if (out / "metrics.json").is_file():
        return json.loads((out / "metrics.json").read_text())
    private = {} if math.isinf(epsilon) else {"dp_epsilon": epsilon, "dp_delta": args.delta, "dp_clip": args.clip}
    config = TrainConfig(
        model=model,
        task="sst2",
        train=files["train"],
        eval=files["eval"],
        out=out,
        steps=args.steps,
        q=args.q,
        seq_len=args.seq_len,
        checkpoint_every=max(args.steps // 10, 1),
        seed=args.seed,
        **({"lr": args.lr} if args.lr is not None else {}),
        **private,
    )
    if not clip_only:
        return train(config, progress=False)
    with (
        mock.patch.object(privacy, "noise_multiplier", lambda *_: 0.0),
        mock.patch.object(privacy, "epsilon_spent", lambda *_: math.inf),
    ):
        return train(config, progress=False)


def main(argv: list[str] | None = None) -> int:
    from shared.tasks import task_data_dir
    from shared.tiny_model import make_tiny_model

    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model or make_tiny_model(args.out / "tiny-model", seed=0)
    data = task_data_dir() / "sst2"
    files = {
        "train": _slice(data / "train.jsonl", args.n_train, args.out / "train.jsonl"),
        "eval": _slice(data / "validation.jsonl", args.n_eval, args.out / "eval.jsonl"),
    }
    rows = []
    print(f"{'epsilon':>8} {'sigma':>7} {'noise std':>9} {'acc before':>10} {'acc after':>9} {'step s':>7}")
    runs = [(e, False) for e in args.epsilons] + ([(8.0, True)] if args.clip_only else [])
    for epsilon, clip_only in runs:
        metrics = run_one(args, model, files, epsilon, clip_only)
        p = metrics.get("privacy") or {}
        row = {
            "epsilon": "clip" if clip_only else epsilon,
            "epsilon_spent": p.get("epsilon"),
            "noise_multiplier": p.get("noise_multiplier"),
            "noise_std": p.get("noise_std"),
            "accuracy_before": metrics["eval"][0]["accuracy"],
            "accuracy_after": metrics["eval"][-1]["accuracy"],
            "step_time_s": metrics["step_time_s"],
        }
        rows.append(row)
        sigma, std = (f"{row[k]:.3f}" if row[k] is not None else "-" for k in ("noise_multiplier", "noise_std"))
        label = "clip" if clip_only else f"{epsilon:g}"
        print(
            f"{label:>8} {sigma:>7} {std:>9} {row['accuracy_before']:>10.3f} {row['accuracy_after']:>9.3f} "
            f"{row['step_time_s']:>7.3f}"
        )
    result = {"model": str(model), "steps": args.steps, "n_train": args.n_train, "n_eval": args.n_eval, "rows": rows}
    (args.out / "results.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
