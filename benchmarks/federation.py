"""What do federated rounds cost and buy? Three questions, one script:

1. Upload bytes per client per round: the log alone against B + log (SmolLM2-135M's B from its architecture, the
   tiny model's from its program; log bytes measured on the simulated clients' real logs), and for a personal job.
2. A simulated federation (in one process, on the same code paths as the server: each client's real MobiZO steps
   on the eager step module → its log → ``shared.replay.replay`` from B_r → ``shared.aggregate``): C clients, each
   holding a label-skewed (non-IID) shard of SST-2, R rounds of K clients × N local steps; the cohort adapter's
   held-out loss per round against one device training alone on its shard for the same total steps (R·K·N); and
   with one poisoned client (its g × 1000, or sign-flipped) under fedavg, trimmed-mean and median.
3. Server cost: replay seconds per client and per round (tiny measured in the federation; SmolLM2-sized B timed
   by replaying an N-step log over its D).

    python -m benchmarks.federation --model /tmp/tw/tiny --data-dir DATA --json-out /tmp/federation.json

The shards come from DATA's ``sst2/train.jsonl`` (``--data-dir``, default ``shared.tasks.task_data_dir()``): the
default 8 shards of 400 need the full SST-2 training set, more than the samples shipped in ``data/`` hold.

Times are wall-clock on a shared machine: read them as orders of magnitude.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from device_agent.batches import Shape, fit_width
from device_agent.local_data import step_batches
from shared.aggregate import next_global_b
from shared.architectures import ARCHS
from shared.b_file import b_file_bytes
from shared.data import answer_len_for, encode, load_examples, pad_token_id, read_jsonl, training_batch
from shared.hf_models import load_model
from shared.manifest import ProgramConfig
from shared.program import build_step_module
from shared.replay import replay
from shared.tasks import TASK_DATA_ENV, get_task, task_data_dir
from shared.train_log import log_line, log_record


@dataclass
class Setup:
    module: torch.nn.Module
    tokenizer: object
    shape: Shape
    d: int
    lr: float
    eps: float


def _setup(args: argparse.Namespace) -> Setup:
    model, tokenizer = load_model(Path(args.model), "float32", "cpu")
    task = get_task("sst2", None, None)
    cfg = ProgramConfig(
        q=args.q,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        answer_len=answer_len_for(task, tokenizer),
        rank=args.rank,
        alpha=2.0 * args.rank,
    )
    module = build_step_module(model, cfg)
    d = int(module.get_lora_b().numel())
    return Setup(module, tokenizer, Shape(cfg.batch_size, cfg.seq_len, cfg.answer_len), d, args.lr, args.eps)


def _shards(data_dir: Path, n_clients: int, per_client: int, skew: float, folder: Path) -> list[Path]:
    """Label-skewed SST-2 shards: client i holds ``skew`` of label i % 2 and the rest of the other label. Disjoint
    shards of ``per_client`` rows each, or a SystemExit naming ``--data-dir`` when the train file is too small."""
    train = data_dir / "sst2" / "train.jsonl"
    rows = read_jsonl(train)
    by_label = {0: [r for r in rows if r["label"] == 0], 1: [r for r in rows if r["label"] == 1]}
    plan = [
        {i % 2: round(skew * per_client), 1 - i % 2: per_client - round(skew * per_client)} for i in range(n_clients)
    ]
    for label, have in by_label.items():
        need = sum(counts[label] for counts in plan)
        if need > len(have):
            raise SystemExit(
                f"{n_clients} shards of {per_client} rows at skew {skew} need {need} SST-2 rows of label {label}; "
                f"{train} has {len(have)}: name the full task data with --data-dir DIR or ${TASK_DATA_ENV}, "
                "or use fewer or smaller shards"
            )
    taken = {0: 0, 1: 0}
    paths = []
    for i, counts in enumerate(plan):
        shard = []
        for label, count in counts.items():
            shard += by_label[label][taken[label] : taken[label] + count]
            taken[label] += count
        path = folder / f"client-{i}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in shard))
        paths.append(path)
    return paths


def _eval_batches(setup: Setup, data_dir: Path, limit: int) -> list:
    task = get_task("sst2", None, None)
    examples = load_examples(task, data_dir / "sst2" / "validation.jsonl", limit=limit)
    encoded = encode(examples, setup.tokenizer, setup.shape.seq_len)
    rows, pad = setup.shape.rows, pad_token_id(setup.tokenizer)
    return [
        training_batch(encoded[i : i + rows], pad, setup.shape.seq_len, setup.shape.answer_len)
        for i in range(0, len(encoded) - rows + 1, rows)
    ]


def _held_out_loss(setup: Setup, b: np.ndarray, batches: list) -> float:
    setup.module.set_lora_b(torch.from_numpy(b.copy()))
    with torch.no_grad():
        losses = [setup.module.evaluate(x.input_ids, x.attention_mask, x.targets) for x in batches]
    return float(torch.cat(losses).mean())


def _local_log(setup: Setup, b: np.ndarray, shard: Path, seed: int, steps: int) -> list[dict]:
    """A client's N real steps from B on its shard → its log records (what its device would upload)."""
    return local_log(setup, b, load_examples(get_task("sst2", None, None), shard), seed, steps)


def local_log(
    setup: Setup, b: np.ndarray, examples: list, seed: int, steps: int, widths: tuple[int, int] | None = None
) -> list[dict]:
    """A device's N real MobiZO steps of the step module from B on its rendered examples, in the batches its agent
    builds (``step_batches``) → its log records (what it would upload; ``shared.replay`` rebuilds its B). With
    ``widths`` (``ProgramConfig.widths``) each batch runs at its longest row, as a device's program runs it."""
    setup.module.set_lora_b(torch.from_numpy(b.copy()))
    records = []
    with torch.no_grad():
        for k, batch in enumerate(step_batches(examples, setup.tokenizer, setup.shape, seed, steps, setup.lr)):
            input_ids, attention_mask = fit_width(batch.input_ids, batch.attention_mask, widths)
            losses, g = setup.module(
                torch.from_numpy(input_ids).long(),
                torch.from_numpy(attention_mask).long(),
                torch.from_numpy(batch.targets).long(),
                torch.tensor([batch.seed]),
                torch.tensor([batch.lr], dtype=torch.float32),
                torch.tensor([setup.eps], dtype=torch.float32),
            )
            records.append(log_record(k, batch.seed, batch.lr, setup.eps, g.numpy(), losses.numpy()))
    return records


def _poison(records: list[dict], factor: float) -> list[dict]:
    """A lying client: its g multiplied by ``factor`` and its losses forged to match, so that each g still follows
    from them as the server checks ((l+ - l-) / (2 eps) in float32): each pair keeps its mean, raised where needed
    so that no loss is negative (× -1 thus swaps the pair)."""
    forged_records = []
    for r in records:
        eps = np.float32(r["eps"])
        g = np.asarray(r["g"], np.float32) * np.float32(factor)
        mid = np.maximum(np.asarray(r["losses"], np.float32).reshape(-1, 2).mean(axis=1), eps * np.abs(g))
        losses = np.stack([mid + eps * g, mid - eps * g], axis=1).astype(np.float32)
        g_forged = (losses[:, 0] - losses[:, 1]) / (eps * np.float32(2))
        forged_records.append(log_record(r["step"], r["seed"], r["lr"], r["eps"], g_forged, losses.ravel()))
    return forged_records


def federate(setup: Setup, shards: list[Path], evals: list, args, method: str, poison: float | None) -> dict:
    """R rounds; round r takes K clients (client 0 — the poisoned one, if any — in every round, the others in
    turn); each replays from B_r; B_{r+1} by ``method``. → held-out loss per round, replay times, log bytes."""
    b = np.zeros(setup.d, np.float32)
    curve, replay_s, log_bytes = [_held_out_loss(setup, b, evals)], [], []
    others = list(range(1, len(shards)))
    for r in range(args.rounds):
        chosen = [0] + [others[(r * (args.per_round - 1) + j) % len(others)] for j in range(args.per_round - 1)]
        client_bs = []
        for slot, client in enumerate(chosen):
            records = _local_log(setup, b, shards[client], 1000 * r + slot + 1, args.local_steps)
            if client == 0 and poison is not None:
                records = _poison(records, poison)
            log_bytes.append(sum(len(log_line(rec)) for rec in records))
            start = time.perf_counter()
            client_bs.append(replay(torch.from_numpy(b.copy()), records).numpy())
            replay_s.append(time.perf_counter() - start)
        b, _ = next_global_b(b, client_bs, method, args.trim_fraction, args.global_lr)
        curve.append(_held_out_loss(setup, b, evals))
    return {"curve": curve, "replay_s": replay_s, "log_bytes": log_bytes}


def alone(setup: Setup, shard: Path, evals: list, args) -> list[float]:
    """One device on its own shard for the same total steps, evaluated after each round's worth (K·N steps)."""
    b, curve = np.zeros(setup.d, np.float32), []
    curve.append(_held_out_loss(setup, b, evals))
    chunk = args.per_round * args.local_steps
    for r in range(args.rounds):
        records = _local_log(setup, b, shard, 7 + r, chunk)
        b = replay(torch.from_numpy(b.copy()), records).numpy()
        curve.append(_held_out_loss(setup, b, evals))
    return curve


def smollm2_d(rank: int) -> int:
    """D for SmolLM2-135M with LoRA on q_proj and v_proj: layers · (q out + v out) · rank."""
    a = ARCHS["smollm2-135m"]
    head = a["hidden_size"] // a["num_attention_heads"]
    return a["num_hidden_layers"] * (a["hidden_size"] + a["num_key_value_heads"] * head) * rank


def upload_bytes(d: int, bytes_per_step: float, steps: int) -> dict:
    log = round(bytes_per_step * steps)
    b = len(b_file_bytes(np.zeros(d, np.float32)))
    return {"d": d, "steps": steps, "log": log, "b": b, "b_plus_log": b + log, "ratio": (b + log) / log}


def replay_seconds(d: int, q: int, steps: int, repeats: int = 1) -> float:
    """Median seconds to replay an N-step log over D (random g; the cost does not depend on the values)."""
    rng = np.random.default_rng(0)
    records = [log_record(k, k + 1, 1e-3, 1e-2, rng.standard_normal(q), np.ones(2 * q)) for k in range(steps)]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        replay(torch.zeros(d), records)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


POISONS = {"x1000": 1000.0, "flip": -1.0}  # the liars: g scaled by the factor (losses forged to match)


def federation_arguments(p: argparse.ArgumentParser, local_steps: int, shard_size: int, lr: float, eval_limit: int):
    """The knobs both federation benchmarks take (this one in one process, ``federation_agents`` with processes)."""
    p.add_argument("--model", required=True, help="the tiny model (mobizo make-tiny-model)")
    p.add_argument("--clients", type=int, default=8, help="C")
    p.add_argument("--per-round", type=int, default=4, help="K")
    p.add_argument("--rounds", type=int, default=10, help="R")
    p.add_argument("--local-steps", type=int, default=local_steps, help="N")
    p.add_argument("--shard-size", type=int, default=shard_size)
    p.add_argument("--skew", type=float, default=0.9, help="share of a client's majority label")
    p.add_argument("--q", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--eps", type=float, default=1e-2)
    p.add_argument("--global-lr", type=float, default=1.0)
    p.add_argument("--trim-fraction", type=float, default=0.25)
    p.add_argument("--eval-limit", type=int, default=eval_limit)
    p.add_argument("--poison", nargs="*", choices=tuple(POISONS), default=list(POISONS), help="the liars")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json-out", type=Path)
    p.add_argument(
        "--data-dir", type=Path, help=f"task data (default: the shipped samples in data/, or ${TASK_DATA_ENV})"
    )


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    federation_arguments(p, local_steps=20, shard_size=400, lr=1e-2, eval_limit=256)
    return p.parse_args()


def main() -> None:
    args = _parse()
    torch.set_num_threads(args.threads)
    data_dir = args.data_dir or task_data_dir()
    setup = _setup(args)
    evals = _eval_batches(setup, data_dir, args.eval_limit)
    with tempfile.TemporaryDirectory() as tmp:
        shards = _shards(data_dir, args.clients, args.shard_size, args.skew, Path(tmp))
        runs = {"fedavg": federate(setup, shards, evals, args, "fedavg", None)}
        for method in ("fedavg", "trimmed-mean", "median"):
            for name in args.poison:
                runs[f"{method} poisoned {name}"] = federate(setup, shards, evals, args, method, POISONS[name])
        solo = alone(setup, shards[1], evals, args)
    per_step = np.mean(runs["fedavg"]["log_bytes"]) / args.local_steps
    sizes = {
        "tiny N=50": upload_bytes(setup.d, per_step, 50),
        "smollm2-135m N=50": upload_bytes(smollm2_d(16), per_step, 50),
        "tiny personal 1000 steps": upload_bytes(setup.d, per_step, 1000),
        "smollm2-135m personal 1000 steps": upload_bytes(smollm2_d(16), per_step, 1000),
    }
    cost = {
        "tiny per client (measured)": float(np.median(runs["fedavg"]["replay_s"])),
        "tiny per round": float(np.median(runs["fedavg"]["replay_s"])) * args.per_round,
        "smollm2-135m per client, N=50": replay_seconds(smollm2_d(16), args.q, 50),
    }
    cost["smollm2-135m per round"] = cost["smollm2-135m per client, N=50"] * args.per_round
    _print(args, setup, sizes, runs, solo, cost)
    if args.json_out:
        args.json_out.write_text(json.dumps({"sizes": sizes, "runs": runs, "alone": solo, "replay": cost}, indent=2))


def _print(args, setup: Setup, sizes: dict, runs: dict, solo: list, cost: dict) -> None:
    print(f"q={args.q}: bytes per client (down: the starting B, once the program is cached; up: log only vs B + log)")
    print("| case | D | down (B) | up: log only | up: B + log | (B + log) / log |\n|---|---|---|---|---|---|")
    for name, s in sizes.items():
        print(f"| {name} | {s['d']:,} | {s['b']:,} | {s['log']:,} | {s['b_plus_log']:,} | {s['ratio']:.1f} |")
    print(f"\nheld-out loss per round (C={args.clients}, K={args.per_round}, R={args.rounds}, N={args.local_steps})")
    heads = " | ".join(str(r) for r in range(args.rounds + 1))
    print(f"| run | {heads} |\n|---|{'---|' * (args.rounds + 1)}")
    for name, run in {**runs, "one device alone (K·N steps per round)": {"curve": solo}}.items():
        print(f"| {name} | " + " | ".join(f"{v:.3f}" if math.isfinite(v) else "nan" for v in run["curve"]) + " |")
    print("\nserver replay seconds")
    for name, seconds in cost.items():
        print(f"| {name} | {seconds:.4f} |")


if __name__ == "__main__":
    main()
