"""Does a job's upload tell whether one example was on the device? A membership-inference audit of the logs.

Trials: ``--trials`` pairs of `mobizo train` runs (eager MobiZO, SST-2, the classification objective) on the
first ``--n-train`` rows of the shipped training sample, one run without and one with a canary (the next row),
each pair with its own seed; once not private (the log holds every step's per-path losses and g) and once private
at ``--epsilon`` (the log holds the noised g alone, ``shared.privacy``).

The attacker is the server, holding what a server holds: the model, B's start, each step's seed and lr (hence B at
every step by replay, and every z), and the canary. It does not hold the device's other rows or which rows formed a
batch. For each run it computes the canary's own losses on the step's 2q paths (B ± eps·z_i) and scores the log:

- **losses** (a log with losses): how close a query's logged losses come to the canary's own, ``-log10`` of the
  smallest relative distance over all steps and queries. With one example per query (``--batch-size`` = ``--q``)
  a query's losses are one example's: a run that drew the canary logs the canary's losses to rounding.
- **g** (any log): a matched filter, the logged g against the canary's own projected differences,
  ``sum g_ti d_ti / sqrt(sum d_ti^2)``; a step that drew the canary moves g towards d.

Per attack: the advantage, max over thresholds of (true-positive rate - false-positive rate) between the runs with
and without the canary, beside the advantage that chance alone reaches with 95 % probability on as many trials
(the in/out labels shuffled, seeded). An attack says something when its advantage is above that line.

    python -m benchmarks.membership --out runs/membership                   # the tiny model
    python -m benchmarks.membership --model runs/smollm2 --trials 16 --out runs/membership-smollm2
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

CHANCE_DRAWS = 2000  # label shuffles behind the chance line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="Hugging Face model folder (default: a fresh tiny model)")
    parser.add_argument("--out", type=Path, required=True, help="runs, data and results.json go here (resumable)")
    parser.add_argument("--trials", type=int, default=16, help="run pairs (without / with the canary) per setting")
    parser.add_argument("--n-train", type=int, default=16, help="the device's rows besides the canary")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--q", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4, help="q x E; E = 1 logs each example's own losses")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--epsilon", type=float, default=8.0, help="the private runs' epsilon (delta 1e-5)")
    parser.add_argument("--clip", type=float, default=1.0)
    args = parser.parse_args(argv)
    if args.trials < 2 or args.n_train < args.batch_size or args.batch_size % args.q:
        parser.error("--trials >= 2, --n-train >= --batch-size, and --batch-size a multiple of --q")
    return args


def _data(args: argparse.Namespace) -> tuple[dict[str, Path], dict[str, Any]]:
    """The two training files (without / with the canary) and the canary's record."""
    from shared.files import atomic_write_bytes
    from shared.tasks import task_data_dir

    lines = (task_data_dir() / "sst2" / "train.jsonl").read_text().splitlines()[: args.n_train + 1]
    files = {"out": args.out / "train-out.jsonl", "in": args.out / "train-in.jsonl"}
    for name, rows in (("out", lines[:-1]), ("in", lines)):
        if not files[name].is_file():
            atomic_write_bytes(files[name], ("\n".join(rows) + "\n").encode())
    return files, json.loads(lines[-1])


def _run(
    args: argparse.Namespace, model: Path, train_file: Path, out: Path, seed: int, private: bool
) -> tuple[list[dict], dict[str, Any]]:
    """One run's uploaded log and its metrics (a finished run is read back)."""
    from shared.train import LOG_FILE, METRICS_FILE, TrainConfig, train
    from shared.train_log import read_log

    if not (out / METRICS_FILE).is_file():
        dp = {"dp_epsilon": args.epsilon, "dp_clip": args.clip} if private else {}
        config = TrainConfig(
            model=model,
            task="sst2",
            train=train_file,
            out=out,
            q=args.q,
            batch_size=args.batch_size,
            steps=args.steps,
            seq_len=args.seq_len,
            seed=seed,
            **dp,
        )
        train(config, progress=False)
    return read_log(out / LOG_FILE, private=private), json.loads((out / METRICS_FILE).read_text())


class Attacker:
    """The canary's own losses on every logged step's paths, from the model, B's start and the log alone."""

    def __init__(self, model: Path, canary: dict[str, Any], run: dict[str, Any]) -> None:
        """``run``: a run's metrics, for its adapter's layout, q and seq_len (what the job's spec tells a server)."""
        import torch

        from shared.data import encode, pad_token_id, resolve_objective, training_batch
        from shared.hf_models import load_model
        from shared.lora import inject_lora
        from shared.tasks import get_task

        task = get_task("sst2")
        self.model, tokenizer = load_model(model)
        _, ids, _ = resolve_objective(task, tokenizer)  # the runs' objective: classification
        self.lora = inject_lora(self.model, tuple(run["targets"]), run["rank"], run["alpha"], run["a_seed"])
        self.q = run["q"]
        (row,) = encode([task.render(canary)], tokenizer, run["seq_len"])
        self.batch = training_batch([row] * self.q, pad_token_id(tokenizer))  # the canary alone in each query
        self.batch.candidates = torch.tensor(ids, dtype=torch.long)

    def canary_losses(self, log: list[dict]) -> np.ndarray:
        """[steps, 2q]: the canary's loss on each step's paths B ± eps·z_i (query-major, + then -)."""
        import torch

        from shared.replay import replay
        from shared.zo import perturbations, rge_losses, step_noise

        b, rows = self.lora.zeros(torch.float32), []
        with torch.no_grad():
            for record in log:
                z = step_noise(torch.tensor([int(record["seed"])]), self.q, b.shape[0])
                paths = perturbations(b, z, torch.tensor([record["eps"]], dtype=torch.float32))
                rows.append(rge_losses(self.model, self.lora, self.batch, paths, self.q, "both", rows=True)[:, 0])
                b = replay(b, [record])
        return torch.stack(rows).double().numpy()


def scores(log: list[dict], canary: np.ndarray) -> dict[str, float | None]:
    """Both attacks' scores of one run's log (``losses`` None for a log without losses)."""
    g = np.array([r["g"] for r in log], dtype=np.float64)
    eps = np.array([r["eps"] for r in log], dtype=np.float64)[:, None]
    d = (canary[:, 0::2] - canary[:, 1::2]) / (2 * eps)
    matched = float((g * d).sum() / math.sqrt(max(float((d * d).sum()), 1e-300)))
    if "losses" not in log[0]:
        return {"losses": None, "g": matched}
    logged = np.array([r["losses"] for r in log], dtype=np.float64)
    distance = np.abs(logged - canary) / np.maximum(np.abs(canary), 1e-30)
    per_query = np.maximum(distance[:, 0::2], distance[:, 1::2])
    return {"losses": float(-np.log10(per_query.min() + 1e-16)), "g": matched}


def advantage(inside: list[float], outside: list[float]) -> float:
    """max over thresholds of TPR - FPR, a higher score meaning 'the canary was in'."""
    a, b = np.asarray(inside), np.asarray(outside)
    cuts = np.concatenate([a, b, [np.inf]])
    return float(max((a >= t).mean() - (b >= t).mean() for t in cuts))


def chance_line(trials: int, seed: int = 0) -> float:
    """The advantage that scores carrying no information reach with 5 % probability (distinct scores, labels
    shuffled): an attack above it is telling in from out."""
    rng = np.random.default_rng(seed)
    values = np.arange(2 * trials, dtype=np.float64)
    draws = []
    for _ in range(CHANCE_DRAWS):
        rng.shuffle(values)
        draws.append(advantage(list(values[:trials]), list(values[trials:])))
    return float(np.quantile(draws, 0.95))


def main(argv: list[str] | None = None) -> int:
    from shared.tiny_model import make_tiny_model

    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.model or make_tiny_model(args.out / "tiny-model", seed=0)
    files, canary = _data(args)
    attacker = None
    settings = {"not private": False, f"epsilon {args.epsilon:g}": True}
    rows, chance = [], chance_line(args.trials)
    print(f"{'setting':>12} {'attack':>7} {'advantage':>9} {'chance (95 %)':>13}")
    for name, private in settings.items():
        found: dict[str, dict[str, list[float]]] = {"in": {}, "out": {}}
        for trial in range(args.trials):
            for side in ("out", "in"):
                folder = args.out / ("private" if private else "open") / f"trial-{trial}-{side}"
                log, metrics = _run(args, model, files[side], folder, 1000 + trial, private)
                attacker = attacker or Attacker(model, canary, metrics)
                for attack, score in scores(log, attacker.canary_losses(log)).items():
                    if score is not None:
                        found[side].setdefault(attack, []).append(score)
        for attack in found["in"]:
            row = {
                "setting": name,
                "private": private,
                "attack": attack,
                "advantage": advantage(found["in"][attack], found["out"][attack]),
                "chance": chance,
                "scores_in": found["in"][attack],
                "scores_out": found["out"][attack],
            }
            rows.append(row)
            print(f"{name:>12} {attack:>7} {row['advantage']:>9.3f} {chance:>13.3f}")
    result = {
        "model": str(model),
        "trials": args.trials,
        "n_train": args.n_train,
        "steps": args.steps,
        "q": args.q,
        "batch_size": args.batch_size,
        "epsilon": args.epsilon,
        "clip": args.clip,
        "rows": rows,
    }
    (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
