"""personal: does each user get a better model, and by how much? The personalization table, user by user.

For every user of the per-user split (``benchmarks.personal_data``: Shakespeare's speaking roles, each user's last
fifth of speeches held out, their own later text) the held-out per-token loss and perplexity of

- (a) the base model;
- (b) the population adapter: ``--rounds`` federated rounds over the users' devices, ``--per-round`` of them a
  round (drawn with the seed), each running ``--local-steps`` MobiZO steps from the round's B on its own training
  text; only its log leaves it, the server replays it (``shared.replay``) and averages the replays
  (``shared.aggregate``, fedavg);
- (c) the user's personal adapter: ``--steps`` MobiZO steps from the base on the user's training text;
- (d) the personal adapter trained from the population adapter (a job's ``init`` adapter), the same steps and
  batches as (c);
- (e) the reference: first-order SGD (backpropagation) on the same coordinates (LoRA-FA's B), from the base, the
  same steps and batches, at ``--fo-lr``;

then, per column, the median and the 25th and 75th percentiles over the users, the share of users whom (d) improves
over (b) (and over (c)), and the device-seconds each column cost a user's device (for (b): every device's rounds,
divided by the users).

In one process, on the code paths of the service, as ``benchmarks.federation`` runs them: a device's steps are the
eager step module's (``shared.program.build_step_module``: the program's mathematics, which
``tests/shared/test_program.py`` holds equal to the ``.pte``), on the batches its agent builds from the ``text``
records (``device_agent.local_data.step_batches``), each run at its longest row as the program runs it; the
held-out figures are the device's own measurement (``device_agent.evaluation.evaluate_program``) on that module.
Device-seconds are this machine's, with ``--threads`` threads: read them as relative costs.

    python -m benchmarks.personal --model models/smollm2 --data-dir DATA --out runs/personal
    python -m benchmarks.personal --model models/tiny --users 3 --steps 4 --rounds 2 --per-round 2 --local-steps 2

``--data-dir`` names the task data folder holding ``shakespeare/input.txt`` (default: the shipped sample, whose
first 3,000 lines hold three users). docs/benchmarks/personal.md has the table and its command.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from benchmarks.federation import Setup, local_log
from benchmarks.personal_data import CORPUS, MIN_CHARS, User, split
from device_agent.batches import Shape, fit_width
from device_agent.evaluation import evaluate_program
from device_agent.local_data import step_batches
from server.federation import client_seed
from shared import defaults
from shared.aggregate import next_global_b
from shared.baselines import fo_lora_step
from shared.batch import Batch, position_ids
from shared.data import encode
from shared.files import atomic_write_bytes
from shared.hf_models import load_model
from shared.manifest import ProgramConfig
from shared.program import build_step_module
from shared.replay import replay
from shared.tasks import Rendered, get_task, task_data_dir

COLUMNS = {
    "a": "base",
    "b": "population",
    "c": "personal from base",
    "d": "personal from population",
    "e": "first-order, from base",
}
LM = defaults.for_method("mobizo", objective="lm")
FO = defaults.for_method("fo-lora", objective="lm")


@dataclass(frozen=True)
class Person:
    """A user's rows: the training text's and the held-out text's (``text`` rows: a line each)."""

    name: str
    seed: int
    train: list[Rendered]
    held_out: list[Rendered]


class EagerEvaluator:
    """The step module's ``evaluate`` (the master B, no perturbation) as a device program's, each chunk at its
    longest row: what ``evaluate_program`` runs."""

    def __init__(self, module: torch.nn.Module, widths: tuple[int, int] | None) -> None:
        self.module, self.widths = module, widths

    def evaluate(self, input_ids: np.ndarray, attention_mask: np.ndarray, targets: np.ndarray) -> np.ndarray:
        ids, mask = fit_width(input_ids, attention_mask, self.widths)
        columns = (torch.from_numpy(np.asarray(a, np.int64)) for a in (ids, mask, targets))
        with torch.no_grad():
            return self.module.evaluate(*columns).numpy()


class Bench:
    """A device as the benchmark runs it: its MobiZO steps (B rebuilt from the log), first-order steps on the same
    batches, and its held-out measurement, all on one step module."""

    def __init__(self, setup: Setup, widths: tuple[int, int] | None) -> None:
        self.setup, self.widths = setup, widths
        self.evaluator = EagerEvaluator(setup.module, widths)

    def loss(self, b: np.ndarray, rows: list[Rendered]) -> float:
        """The held-out per-token loss of ``b`` on ``rows``."""
        self.setup.module.set_lora_b(torch.from_numpy(b.copy()))
        return evaluate_program(self.evaluator, rows, self.setup.tokenizer, self.setup.shape, "lm")["loss"]

    def zo(self, b: np.ndarray, rows: list[Rendered], seed: int, steps: int) -> tuple[np.ndarray, float]:
        """MobiZO steps from ``b`` → (B as the server's replay of the device's log rebuilds it, device-seconds)."""
        started = time.perf_counter()
        records = local_log(self.setup, b, rows, seed, steps, self.widths)
        seconds = time.perf_counter() - started
        return replay(torch.from_numpy(b.copy()), records).numpy(), seconds

    def first_order(self, b: np.ndarray, rows: list[Rendered], seed: int, steps: int, lr: float):
        """First-order SGD on B from ``b``, the batches of the ZO run of the same seed → (B, device-seconds)."""
        setup, flat = self.setup, torch.from_numpy(b.copy())
        lr_t = torch.tensor([lr], dtype=torch.float32)
        started = time.perf_counter()
        for batch in step_batches(rows, setup.tokenizer, setup.shape, seed, steps, lr):
            ids, mask = fit_width(batch.input_ids, batch.attention_mask, self.widths)
            mask_t = torch.from_numpy(np.asarray(mask, np.int64))
            ids_t, targets = torch.from_numpy(np.asarray(ids, np.int64)), torch.from_numpy(batch.targets).long()
            fo_lora_step(
                setup.module.model, setup.module.lora, Batch(ids_t, mask_t, position_ids(mask_t), targets), flat, lr_t
            )
        return flat.numpy(), time.perf_counter() - started


def people(users: list[User], seed: int) -> list[Person]:
    task = get_task("text")
    rows = lambda records: [row for record in records for row in task.rows(record)]  # noqa: E731
    return [Person(u.name, seed * 100_003 + i, rows(u.train), rows(u.held_out)) for i, u in enumerate(users)]


def longest_answer(persons: list[Person], tokenizer) -> int:
    """Tokens of the longest line any user's rows predict: the answer length the program needs."""
    rows = [row for p in persons for row in p.train + p.held_out]
    return max(len(e.candidate_ids[0]) for e in encode(rows, tokenizer))


def population(bench: Bench, persons: list[Person], args) -> tuple[np.ndarray, float]:
    """``args.rounds`` rounds of ``args.per_round`` users each (at most all of them, drawn with the seed), each
    from the round's B with the server's client seed → (the last round's B, every device's seconds together)."""
    b = np.zeros(bench.setup.d, np.float32)
    seconds, per_round = 0.0, min(args.per_round, len(persons))
    for r in range(args.rounds):
        chosen = random.Random(args.seed * 1_000_003 + r).sample(range(len(persons)), per_round)
        client_bs = []
        for slot, i in enumerate(chosen):
            b_i, spent = bench.zo(b, persons[i].train, client_seed(args.seed, r, slot), args.local_steps)
            client_bs.append(b_i)
            seconds += spent
        b, _ = next_global_b(b, client_bs, "fedavg", 0.0, args.global_lr)
        print(f"round {r + 1}/{args.rounds}: {seconds:.1f} device-s so far", file=sys.stderr, flush=True)
    return b, seconds


def quartiles(values: list[float]) -> dict[str, float]:
    p25, median, p75 = np.percentile(np.asarray(values, np.float64), [25, 50, 75])
    return {"p25": float(p25), "median": float(median), "p75": float(p75)}


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    data = args.data_dir or task_data_dir()
    users = split(data / CORPUS, args.min_chars, args.users, args.seed)
    model, tokenizer = load_model(Path(args.model), "float32", "cpu")
    persons = people(users, args.seed)
    answer_len = args.answer_len or longest_answer(persons, tokenizer)
    cfg = ProgramConfig(
        q=args.q,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        answer_len=answer_len,
        rank=args.rank,
        alpha=defaults.alpha_for(args.rank),
    )
    module = build_step_module(model, cfg)
    shape = Shape(cfg.batch_size, cfg.seq_len, cfg.answer_len)
    setup = Setup(module, tokenizer, shape, int(module.get_lora_b().numel()), args.lr, args.eps)
    bench = Bench(setup, cfg.widths)
    print(f"{len(persons)} users, answer_len {answer_len}, D {setup.d}", file=sys.stderr, flush=True)

    zeros = np.zeros(setup.d, np.float32)
    b_pop, pop_seconds = population(bench, persons, args) if args.rounds else (zeros, 0.0)
    rows, started = [], time.perf_counter()
    for done, p in enumerate(persons):
        b_c, c_s = bench.zo(zeros, p.train, p.seed, args.steps)
        b_d, d_s = bench.zo(b_pop, p.train, p.seed, args.steps)
        b_e, e_s = bench.first_order(zeros, p.train, p.seed, args.fo_steps or args.steps, args.fo_lr)
        losses = {k: bench.loss(b, p.held_out) for k, b in zip("abcde", (zeros, b_pop, b_c, b_d, b_e), strict=True)}
        seconds = {"a": 0.0, "b": pop_seconds / len(persons), "c": c_s, "d": d_s, "e": e_s}
        rows.append(
            {"user": p.name, "train_rows": len(p.train), "held_out_rows": len(p.held_out)}
            | {
                "loss": losses,
                "device_s": seconds,
            }
        )
        shown = " ".join(f"{k} {v:.3f}" for k, v in losses.items())
        left = (time.perf_counter() - started) / (done + 1) * (len(persons) - done - 1)
        print(f"{p.name}: {shown} ({left / 60:.0f} min to go)", file=sys.stderr, flush=True)
    return summarize(rows, args, answer_len, pop_seconds)


def summarize(rows: list[dict], args, answer_len: int, pop_seconds: float) -> dict:
    columns = {}
    for k, name in COLUMNS.items():
        losses = [r["loss"][k] for r in rows]
        seconds = [r["device_s"][k] for r in rows]
        q = quartiles(losses)
        columns[k] = {
            "name": name,
            "loss": q,
            "perplexity": {s: math.exp(v) for s, v in q.items()},
            "device_s_per_user": quartiles(seconds)["median"],
        }
    n = len(rows)
    better = {
        "d_over_b": sum(r["loss"]["d"] < r["loss"]["b"] for r in rows) / n,
        "d_over_c": sum(r["loss"]["d"] < r["loss"]["c"] for r in rows) / n,
        "c_over_a": sum(r["loss"]["c"] < r["loss"]["a"] for r in rows) / n,
    }
    median = {k: c["loss"]["median"] for k, c in columns.items()}
    config = {k: v for k, v in vars(args).items() if k not in ("out",)} | {"answer_len": answer_len}
    return {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in config.items()},
        "users": n,
        "columns": columns,
        "better": better,
        "d_le_b_le_a": median["d"] <= median["b"] <= median["a"],
        "population_device_s": pop_seconds,
        "rows": rows,
    }


def table(result: dict) -> str:
    lines = [
        f"{result['users']} users; held-out per-token loss (perplexity), over the users:",
        "",
        "| column | median | 25th percentile | 75th percentile | device-s per user |",
        "|---|---|---|---|---|",
    ]
    for k, c in result["columns"].items():
        cells = " | ".join(f"{c['loss'][s]:.3f} ({c['perplexity'][s]:.1f})" for s in ("median", "p25", "p75"))
        lines.append(f"| ({k}) {c['name']} | {cells} | {c['device_s_per_user']:.1f} |")
    b = result["better"]
    lines += [
        "",
        f"(d) improves over (b) for {b['d_over_b']:.0%} of the users, over (c) for {b['d_over_c']:.0%}; "
        f"(c) over (a) for {b['c_over_a']:.0%}. (d) <= (b) <= (a) in median loss: {result['d_le_b_le_a']}. "
        f"The population's rounds: {result['population_device_s']:.1f} device-seconds in all.",
    ]
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a model folder (mobizo models import, mobizo make-tiny-model)")
    p.add_argument("--data-dir", type=Path, help=f"task data holding {CORPUS} (default: the shipped sample)")
    p.add_argument("--min-chars", type=int, default=MIN_CHARS, help="a user's speeches hold at least this many")
    p.add_argument("--users", type=int, help="draw this many users with the seed (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--q", type=int, default=defaults.Q)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=96)
    p.add_argument("--answer-len", type=int, help="default: the longest line any user's rows predict")
    p.add_argument("--rank", type=int, default=LM.rank)
    p.add_argument("--lr", type=float, default=LM.lr)
    p.add_argument("--eps", type=float, default=LM.eps)
    p.add_argument("--steps", type=int, default=50, help="a personal adapter's steps, (c) and (d)")
    p.add_argument("--rounds", type=int, default=10, help="the population's rounds (0: none, (b) is the base)")
    p.add_argument("--per-round", type=int, default=8, help="users a round")
    p.add_argument("--local-steps", type=int, default=5, help="a user's steps in a round")
    p.add_argument("--global-lr", type=float, default=1.0)
    p.add_argument("--fo-lr", type=float, default=FO.lr, help="(e)'s learning rate")
    p.add_argument("--fo-steps", type=int, help="(e)'s steps (default: --steps)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, help="write personal.json and personal.md here")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len", "q", "rank", "threads"):
        if getattr(args, name) < 1:
            p.error(f"argument --{name.replace('_', '-')}: must be at least 1")
    if args.rounds < 0 or args.local_steps < 1 or args.per_round < 1:
        p.error("argument --rounds: must be at least 0, with --per-round and --local-steps at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    started = time.perf_counter()
    result = run(args)
    result["wall_s"] = time.perf_counter() - started
    text = table(result)
    print(text)
    if args.out:
        atomic_write_bytes(args.out / "personal.json", json.dumps(result, indent=2).encode())
        atomic_write_bytes(args.out / "personal.md", (text + "\n").encode())


if __name__ == "__main__":
    main()
