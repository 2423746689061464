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
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from benchmarks.federation import Setup, local_log
from benchmarks.personal_data import CORPUS, MIN_CHARS, User, split
from benchmarks.sweep import equal_forward_steps
from device_agent.batches import Shape, fit_width
from device_agent.evaluation import evaluate_program
from device_agent.local_data import step_batches
from server.federation import client_seed
from shared import defaults
from shared.aggregate import next_global_b
from shared.baselines import fo_lora_step
from shared.batch import Batch, position_ids
from shared.data import encode
from shared.errors import DataError, UsageError
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
    "f": "standing job, nights from population",
}
LM = defaults.for_method("mobizo", objective="lm")
FO = defaults.for_method("fo-lora", objective="lm")


@dataclass(frozen=True)
class Person:
    """A user's rows: the training text's and the held-out text's (``text`` rows: a line each); ``days``: the
    training rows the device holds after each of the ``--nights`` days (its speeches revealed in order)."""

    name: str
    seed: int
    train: list[Rendered]
    held_out: list[Rendered]
    days: list[list[Rendered]]


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

    def log(self, b: np.ndarray, rows: list[Rendered], seed: int, steps: int) -> tuple[list[dict], float]:
        """MobiZO steps from ``b`` → (the device's log, the seconds they took here)."""
        started = time.perf_counter()
        records = local_log(self.setup, b, rows, seed, steps, self.widths)
        return json.loads(json.dumps(records)), time.perf_counter() - started  # as uploaded: JSON

    def zo(self, b: np.ndarray, rows: list[Rendered], seed: int, steps: int) -> tuple[np.ndarray, float]:
        """MobiZO steps from ``b`` → (B as the server's replay of the device's log rebuilds it, seconds here)."""
        records, seconds = self.log(b, rows, seed, steps)
        return replay(b, records), seconds

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


def people(users: list[User], seed: int, nights: int = 1) -> list[Person]:
    """Each user's rows; day k of ``nights`` holds the first ceil(k·n / nights) of their n training speeches."""
    task = get_task("text")
    rows = lambda records: [row for record in records for row in task.rows(record)]  # noqa: E731
    days = lambda u: [rows(u.train[: math.ceil(k * len(u.train) / nights)]) for k in range(1, nights + 1)]  # noqa: E731
    return [Person(u.name, seed * 100_003 + i, rows(u.train), rows(u.held_out), days(u)) for i, u in enumerate(users)]


def longest_answer(persons: list[Person], tokenizer) -> int:
    """Tokens of the longest line any user's rows predict: the answer length the program needs."""
    rows = [row for p in persons for row in p.train + p.held_out]
    return max(len(e.candidate_ids[0]) for e in encode(rows, tokenizer))


def population(bench: Bench, persons: list[Person], args, progress: Progress) -> tuple[np.ndarray, int]:
    """``args.rounds`` rounds of ``args.per_round`` users each (at most all of them, drawn with the seed), each
    from the round's B with the server's client seed → (the last round's B, every device's steps together). A round
    in ``progress`` is rebuilt from its clients' logs (the server's replay), not run again."""
    b = np.zeros(bench.setup.d, np.float32)
    per_round = min(args.per_round, len(persons))
    for r in range(args.rounds):
        logs = progress.rounds.get(r)
        if logs is None:
            chosen = random.Random(args.seed * 1_000_003 + r).sample(range(len(persons)), per_round)
            logs = [
                bench.log(b, persons[i].train, client_seed(args.seed, r, slot), args.local_steps)[0]
                for slot, i in enumerate(chosen)
            ]
            progress.add({"kind": "round", "round": r, "logs": logs})
        b, _ = next_global_b(b, [replay(b, log) for log in logs], "fedavg", 0.0, args.global_lr)
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    return b, args.rounds * per_round * args.local_steps


def quartiles(values: list[float]) -> dict[str, float]:
    p25, median, p75 = np.percentile(np.asarray(values, np.float64), [25, 50, 75])
    return {"p25": float(p25), "median": float(median), "p75": float(p75)}


class Progress:
    """The run so far, ``OUT/progress.jsonl`` (None: kept in memory only): a line for the configuration, then one
    per calibration, round (its clients' logs) and user (the row), each appended and synced as it ends. A rerun
    with the same configuration continues where the last one stopped; another configuration is refused."""

    def __init__(self, path: Path | None, config: dict) -> None:
        self.path, self.rounds, self.users, self.calibrations = path, {}, {}, []
        lines = path.read_text().splitlines() if path is not None and path.exists() else []
        records = []
        for i, line in enumerate(lines):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                if i < len(lines) - 1:  # only the last line can be cut short (a run stopped while writing it)
                    raise UsageError("out", f"{path}: line {i + 1} is not JSON") from None
        if records and records[0].get("config") != config:
            was = records[0].get("config") or {}
            differ = sorted(k for k in config.keys() | was.keys() if config.get(k) != was.get(k))
            raise UsageError("out", f"{path} is a run of another configuration ({', '.join(differ)}): use another")
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps(r) + "\n" for r in records or [{"kind": "config", "config": config}]))
        for record in records[1:]:
            self._keep(record)

    def add(self, record: dict) -> None:
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())
        self._keep(record)

    def _keep(self, record: dict) -> None:
        if record["kind"] == "round":
            self.rounds[record["round"]] = record["logs"]
        elif record["kind"] == "user":
            self.users[record["row"]["user"]] = record["row"]
        else:
            self.calibrations.append(record)

    def step_s(self) -> dict[str, float]:
        """A step's seconds of each kind: the least of the calibrations (the one least disturbed by other work)."""
        return {k: min(c[k] for c in self.calibrations) for k in ("zo", "fo")}


def calibrate(bench: Bench, person: Person, args) -> dict:
    """The seconds of a MobiZO step and of a first-order step on the first user's first batches, after one step to
    warm up: what the columns' device-seconds are counted in (a run that shares the machine still counts right when
    one of its starts had it alone)."""
    zeros = np.zeros(bench.setup.d, np.float32)
    bench.log(zeros, person.train, person.seed, 1)
    zo = bench.log(zeros, person.train, person.seed, 3)[1] / 3
    fo = bench.first_order(zeros, person.train, person.seed, 2, args.fo_lr)[1] / 2
    return {"kind": "calibration", "zo": zo, "fo": fo, "threads": args.threads}


def nights(bench: Bench, p: Person, b: np.ndarray, loss: float, args) -> list[dict]:
    """A standing personal job over ``args.nights`` nights: each night's session starts from the promoted adapter
    (at first ``b``, of held-out loss ``loss``), trains ``night_steps`` on the text the device holds that day, and
    is promoted if its held-out loss is below the one it started from (the server's rule,
    ``server.state.sessions.promotes``)."""
    out = []
    for k, rows in enumerate(p.days):
        b_k, _ = bench.zo(b, rows, p.seed + 1_000_000 * (k + 1), args.night_steps)
        after = bench.loss(b_k, p.held_out)
        promoted = after < loss
        if promoted:
            b, loss = b_k, after
        out.append({"loss": after, "promoted": promoted, "served": loss})
    return out


def measure(bench: Bench, p: Person, b_pop: np.ndarray, args) -> dict:
    """The user's row: each column's held-out loss, the steps it cost the user's device, the nights."""
    zeros = np.zeros(bench.setup.d, np.float32)
    b_c, _ = bench.zo(zeros, p.train, p.seed, args.steps)
    b_d, _ = bench.zo(b_pop, p.train, p.seed, args.steps)
    b_e, _ = bench.first_order(zeros, p.train, p.seed, args.fo_steps, args.fo_lr)
    losses = {k: bench.loss(b, p.held_out) for k, b in zip("abcde", (zeros, b_pop, b_c, b_d, b_e), strict=True)}
    series = nights(bench, p, b_pop, losses["b"], args) if args.nights else []
    losses["f"] = series[-1]["served"] if series else losses["b"]
    steps = {"c": args.steps, "d": args.steps, "e": args.fo_steps, "f": args.nights * args.night_steps}
    return {"user": p.name, "train_rows": len(p.train), "held_out_rows": len(p.held_out), "loss": losses} | {
        "steps": steps,
        "nights": series,
    }


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    data = args.data_dir or task_data_dir()
    users = split(data / CORPUS, args.min_chars, args.users, args.seed)
    model, tokenizer = load_model(Path(args.model), "float32", "cpu")
    persons = people(users, args.seed, max(args.nights, 1))
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
    progress = Progress(args.out / "progress.jsonl" if args.out else None, config_of(args, answer_len))
    done = len(progress.users)
    print(f"{len(persons)} users ({done} measured before), answer_len {answer_len}, D {setup.d}", file=sys.stderr)
    progress.add(calibrate(bench, persons[0], args))
    b_pop, pop_steps = population(bench, persons, args, progress) if args.rounds else (np.zeros(setup.d, np.float32), 0)
    started = time.perf_counter()
    for p in [p for p in persons if p.name not in progress.users]:
        row = measure(bench, p, b_pop, args)
        progress.add({"kind": "user", "row": row})
        shown = " ".join(f"{k} {v:.3f}" for k, v in row["loss"].items())
        done, spent = done + 1, time.perf_counter() - started
        print(f"{p.name}: {shown} ({done}/{len(persons)}, {spent / 60:.0f} min)", file=sys.stderr, flush=True)
    return summarize([progress.users[p.name] for p in persons], args, answer_len, pop_steps, progress.step_s())


def config_of(args, answer_len: int) -> dict:
    """What a run's figures depend on (not where they go, nor the threads): a rerun must match it to continue."""
    config = {k: v for k, v in vars(args).items() if k not in ("out", "threads")} | {"answer_len": answer_len}
    return {k: str(v) if isinstance(v, Path) else v for k, v in config.items()}


def summarize(rows: list[dict], args, answer_len: int, pop_steps: int, step_s: dict[str, float]) -> dict:
    """Per column the quartiles of held-out loss and its device-seconds per user (steps × the calibrated step:
    (b) is every device's round steps divided by the users; (e) counts first-order steps); the shares improved; the
    nights' served loss and promotions, night by night."""
    n = len(rows)
    steps = {"a": 0, "b": pop_steps / n, **{k: rows[0]["steps"][k] for k in "cdf"}, "e": rows[0]["steps"]["e"]}
    columns = {}
    for k, name in COLUMNS.items():
        q = quartiles([r["loss"][k] for r in rows])
        kind = "fo" if k == "e" else "zo"
        columns[k] = {
            "name": name,
            "loss": q,
            "perplexity": {s: math.exp(v) for s, v in q.items()},
            "steps_per_user": steps[k],
            "device_s_per_user": steps[k] * step_s[kind],
        }
    better = {
        "d_over_b": sum(r["loss"]["d"] < r["loss"]["b"] for r in rows) / n,
        "d_over_c": sum(r["loss"]["d"] < r["loss"]["c"] for r in rows) / n,
        "c_over_a": sum(r["loss"]["c"] < r["loss"]["a"] for r in rows) / n,
    }
    median = {k: c["loss"]["median"] for k, c in columns.items()}
    per_night = [
        {
            "served": quartiles([r["nights"][k]["served"] for r in rows]),
            "promoted": sum(r["nights"][k]["promoted"] for r in rows) / n,
        }
        for k in range(len(rows[0]["nights"]))
    ]
    return {
        "config": config_of(args, answer_len),
        "users": n,
        "step_s": step_s,
        "columns": columns,
        "better": better,
        "d_le_b_le_a": median["d"] <= median["b"] <= median["a"],
        "population_device_s": pop_steps * step_s["zo"],
        "nights": per_night,
        "rows": rows,
    }


def table(result: dict) -> str:
    lines = [
        f"{result['users']} users; held-out per-token loss (perplexity), over the users:",
        "",
        "| column | median | 25th percentile | 75th percentile | steps per user | device-s per user |",
        "|---|---|---|---|---|---|",
    ]
    for k, c in result["columns"].items():
        cells = " | ".join(f"{c['loss'][s]:.3f} ({c['perplexity'][s]:.1f})" for s in ("median", "p25", "p75"))
        lines.append(f"| ({k}) {c['name']} | {cells} | {c['steps_per_user']:g} | {c['device_s_per_user']:.0f} |")
    b, step_s = result["better"], result["step_s"]
    lines += [
        "",
        f"(d) improves over (b) for {b['d_over_b']:.0%} of the users, over (c) for {b['d_over_c']:.0%}; "
        f"(c) over (a) for {b['c_over_a']:.0%}. (d) <= (b) <= (a) in median loss: {result['d_le_b_le_a']}. "
        f"The population's rounds: {result['population_device_s']:.0f} device-seconds in all. A step: "
        f"{step_s['zo']:.2f} s (MobiZO), {step_s['fo']:.2f} s (first-order).",
    ]
    if result["nights"]:
        lines += ["", "| night | served loss, median (25th, 75th) | promoted |", "|---|---|---|"]
        for k, night in enumerate(result["nights"], 1):
            q = night["served"]
            lines.append(f"| {k} | {q['median']:.3f} ({q['p25']:.3f}, {q['p75']:.3f}) | {night['promoted']:.0%} |")
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
    p.add_argument(
        "--fo-steps",
        type=int,
        help="(e)'s steps (default: 2/3 of --steps, the same forward passes: a MobiZO step is two forwards of its "
        "batch, a first-order step about three)",
    )
    p.add_argument("--nights", type=int, default=3, help="(f): the standing job's nights, the text revealed by day")
    p.add_argument("--night-steps", type=int, help="(f): a night's steps (default: --steps / --nights, rounded up)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, help="write personal.json and personal.md here")
    args = p.parse_args(argv)
    args.fo_steps = args.fo_steps or equal_forward_steps(args.steps)
    args.night_steps = args.night_steps or math.ceil(args.steps / max(args.nights, 1))
    for name in ("steps", "batch_size", "seq_len", "q", "rank", "threads"):
        if getattr(args, name) < 1:
            p.error(f"argument --{name.replace('_', '-')}: must be at least 1")
    if args.nights < 0 or args.fo_steps < 1 or args.night_steps < 1:
        p.error("argument --nights: must be at least 0, with --fo-steps and --night-steps at least 1")
    if args.rounds < 0 or args.local_steps < 1 or args.per_round < 1:
        p.error("argument --rounds: must be at least 0, with --per-round and --local-steps at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    started = time.perf_counter()
    try:
        result = run(args)
    except (UsageError, DataError) as exc:
        raise SystemExit(f"personal: {exc}") from None
    result["wall_s"] = time.perf_counter() - started
    text = table(result)
    print(text)
    if args.out:
        atomic_write_bytes(args.out / "personal.json", json.dumps(result, indent=2).encode())
        atomic_write_bytes(args.out / "personal.md", (text + "\n").encode())


if __name__ == "__main__":
    main()
