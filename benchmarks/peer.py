"""The peer a user would pick instead: ExecuTorch's own first-order training of the same LoRA, beside mobizo's step.

Both programs train the same adapter coordinates (LoRA-FA: A and the base frozen, B trained; the job's rank, targets
and A seed), read the same rows through the same prompt and objective, and run in the same ExecuTorch runtime on the
same XNNPACK kernels. They differ in the step alone: mobizo's ``forward`` is a whole zeroth-order step (2q perturbed
paths in one pass, B updated inside; ``shared.program``), the peer's is a forward and backward pass of the loss whose
gradient ExecuTorch's SGD applies (``executorch.extension.training``; ``shared.fo_program``).

One command, run alone on the machine, in three parts:

- **programs**: each exported once into ``OUT/sweep/programs`` (seconds, ``.pte`` and ``.ptd`` bytes), and an
  inference forward of the same rows (the step's 2q·E paths for mobizo, its E·q rows for the peer;
  ``benchmarks.program.PlainForward``);
- **memory**: each program in a fresh process, loaded as a device loads it, one step at its widest rows: the peak
  RSS over the RSS before the program was loaded (the interpreter, torch and the runtime's library left out), and
  that of the inference forward of the same rows;
- **learning**: the accuracy benchmark's sample (``benchmarks.sweep``: 1,000 training rows, the test set), each
  method over ``--seeds`` through its program, the sweep's ``defaults`` (a job's defaults) against its
  ``fo-lora-lr-1.6e-1`` (first-order at the job's coordinates and schedule, its best lr); test accuracy against
  device-seconds (steps x the run's median step time).

What each uploads: mobizo a B and a log of seeds and scalars that the server replays to that B bit for bit
(``server.verify``); the peer a B alone, which nothing on the server can check. The table says it beside the
figures. Outputs: the tables on stdout, ``OUT/peer.json``, ``OUT/peer.png`` (accuracy against device-seconds, and the
last accuracy against a step's peak memory). Resumable as the sweep is: the same command continues a killed run.

    python -m benchmarks.peer --model models/smollm2 --data-dir DATA --out runs/peer
    python -m benchmarks.peer --model models/smollm2 --data-dir DATA --seeds 0 --steps 50 --out runs/peer-short
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
from pathlib import Path
from typing import Any

METHODS = {"mobizo": "defaults", "first-order": "fo-lora-lr-1.6e-1"}  # the row -> the sweep's variant
UPLOADS = {
    "mobizo": "B + a log the server replays to it (verified)",
    "first-order": "B alone (nothing to replay: unverified)",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--model", required=True, type=Path, metavar="DIR", help="Hugging Face model folder")
    add("--out", required=True, type=Path, metavar="DIR", help="results folder (resumable: rerun to continue)")
    add("--data-dir", type=Path, help="task data (default: the shipped samples in data/, or $MOBIZO_TASK_DATA_DIR)")
    add("--task", default="sst2")
    add("--seeds", default="0,1,2", help="comma-separated run seeds")
    add("--steps", type=int, default=200)
    add("--eval-every", type=int, default=50, metavar="K")
    add("--n-test", type=int, default=1000)
    add("--threads", type=int, default=2, help="torch and XNNPACK threads of the runs")
    add("--budget", type=float, default=300.0, metavar="S", help="the device-seconds column (default 300)")
    add("--no-plot", action="store_true")
    return parser.parse_args(argv)


def _sweep_args(args: argparse.Namespace) -> list[str]:
    argv = ["--model", str(args.model), "--out", str(args.out / "sweep"), "--task", args.task]
    argv += ["--variants", ",".join(METHODS.values()), "--seeds", args.seeds, "--steps", str(args.steps)]
    argv += ["--eval-every", str(args.eval_every), "--n-test", str(args.n_test), "--runner", "program"]
    argv += ["--threads", str(args.threads), "--budget", str(args.budget), "--no-plot"]
    return argv + (["--data-dir", str(args.data_dir)] if args.data_dir else [])


def programs(folder: Path) -> dict[str, dict[str, Any]]:
    """The two programs the sweep exported into ``folder`` → per method: its .pte, .ptd, config, rows and export."""
    from shared.manifest import FirstOrderManifest, read_training_manifest

    found: dict[str, dict[str, Any]] = {}
    for manifest_file in sorted(folder.glob("*/program.json")):
        pte = manifest_file.with_suffix(".pte")
        manifest = read_training_manifest(pte)
        method = "first-order" if isinstance(manifest, FirstOrderManifest) else "mobizo"
        config = manifest.config
        seconds = manifest_file.parent / "export_s.txt"
        found[method] = {
            "pte": pte,
            "ptd": pte.parent / manifest.ptd.file,
            "config": config,
            "lora_size": manifest.lora_size,
            "export_s": float(seconds.read_text()) if seconds.is_file() else None,
            "pte_bytes": pte.stat().st_size,
            "ptd_bytes": (pte.parent / manifest.ptd.file).stat().st_size,
            # rows of one forward: the 2q perturbed paths of E rows each, or the batch's rows once
            "rows": config.batch_size * (2 if method == "mobizo" else 1),
        }
    missing = set(METHODS) - set(found)
    if missing:
        raise SystemExit(f"{folder}: no exported program for {', '.join(sorted(missing))}")
    return found


def _step_inputs(config, rows: int, vocab: int):
    import torch

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (rows, config.seq_len), generator=gen)
    answers = torch.tensor(config.candidates or (3,))
    targets = answers[torch.randint(0, len(answers), (rows, 1), generator=gen)]
    return ids, torch.ones_like(ids), targets.repeat(1, config.answer_len)


def _memory_child(kind: str, pte: str, ptd: str, config_json: str, lora_size: int, vocab: int, queue) -> None:
    """One step (or one inference forward) in this fresh process → its peak RSS over the RSS before loading."""
    import numpy as np
    import torch
    from executorch.runtime import Runtime

    from benchmarks.program_steps import FirstOrderStep
    from benchmarks.step_time import CpuMemory
    from device_agent.batches import StepBatch
    from device_agent.et_program import ProgramSession
    from shared.batch import Batch
    from shared.manifest import ProgramConfig, read_first_order_manifest

    torch.set_num_threads(1)
    config = ProgramConfig.model_validate_json(config_json)
    Runtime.get()  # the runtime's library in memory before the baseline
    probe = CpuMemory()
    probe.start()
    base = probe.before
    if kind == "mobizo":
        session = ProgramSession(Path(pte), Path(ptd), evaluate=False, widths=config.widths)
        session.set_b(np.zeros(lora_size, np.float32))
        ids, mask, targets = _step_inputs(config, config.batch_size, vocab)
        batch = StepBatch(1, 1e-4, ids.numpy(), mask.numpy(), targets.numpy())
        run = lambda: session.step(batch, 1e-4, 1e-2)  # noqa: E731
    elif kind == "first-order":
        step = FirstOrderStep(Path(pte), Path(ptd), read_first_order_manifest(Path(pte)))
        ids, mask, targets = _step_inputs(config, config.batch_size, vocab)
        run = lambda: step(Batch(ids, mask, None, targets), seed=0, lr=1e-4)  # noqa: E731
    else:  # an inference forward of ``rows`` rows: benchmarks.program's PlainForward
        program = Runtime.get().load_program(Path(pte), data_path=Path(ptd))
        forward = program.load_method("forward")
        rows = int(kind.split(":")[1])
        inputs = list(_step_inputs(config, rows, vocab))
        run = lambda: forward.execute(inputs)  # noqa: E731
    run()  # warm: the delegate's first run allocates its workspace
    peak, _ = probe.stop()
    queue.put({"peak_mb": peak - base})


def memory(kind: str, pte: Path, ptd: Path, config, lora_size: int, vocab: int) -> float:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    args = (kind, str(pte), str(ptd), config.model_dump_json(), lora_size, vocab, queue)
    proc = ctx.Process(target=_memory_child, args=args)
    proc.start()
    proc.join()  # the child's answer is a few bytes: the queue holds it without a reader
    if proc.exitcode != 0:
        raise SystemExit(f"peer: measuring the memory of {kind} failed (exit code {proc.exitcode})")
    return queue.get()["peak_mb"]


def inference_program(model: Path, config, rows: int, folder: Path) -> tuple[Path, Path, dict]:
    """The plain forward of ``rows`` rows of ``config``'s shape (``benchmarks.program``'s), exported once."""
    from benchmarks.program import INFERENCE, export_measured, inference_weights, program_path

    shaped = config.model_copy(update={"batch_size": rows // 2, "q": 1, "parallel": "none"})
    pte = program_path(folder, shaped, INFERENCE)
    folder.mkdir(parents=True, exist_ok=True)
    info = export_measured(model, shaped, pte, INFERENCE)
    return pte, inference_weights(pte), info


def measure_programs(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Export (through the sweep's cache), then each program's and its inference forward's step memory."""
    from transformers import AutoConfig

    found = programs(args.out / "sweep" / "programs")
    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    saved = args.out / "programs.json"
    done = json.loads(saved.read_text()) if saved.is_file() else {}
    for method, info in found.items():
        if method not in done:
            pte, ptd, _ = inference_program(args.model, info["config"], info["rows"], args.out / "inference")
            step_mb = memory(method, info["pte"], info["ptd"], info["config"], info["lora_size"], vocab)
            forward_mb = memory(f"inference:{info['rows']}", pte, ptd, info["config"], info["lora_size"], vocab)
            done[method] = {key: info[key] for key in ("export_s", "pte_bytes", "ptd_bytes", "rows", "lora_size")} | {
                "step_mb": step_mb,
                "inference_mb": forward_mb,
                "seq_len": info["config"].seq_len,
            }
            saved.write_text(json.dumps(done, indent=2))
    return done


def learning(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """The sweep's runs of each method (``benchmarks.sweep``, ``--runner program``) → per method, its runs."""
    from benchmarks.sweep import main as sweep
    from benchmarks.sweep import read_results

    if sweep(_sweep_args(args)) != 0:
        raise SystemExit("the sweep failed")
    runs = read_results(args.out / "sweep" / "results")
    return {method: [r for r in runs if r["variant"] == variant] for method, variant in METHODS.items()}


def _mean(values: list[float]) -> float:
    return statistics.mean(values) if values else float("nan")


def summary(runs: list[dict[str, Any]], budget: float) -> dict[str, float]:
    from benchmarks.sweep import at_budget

    return {
        "step_s": _mean([r["step_time_s"] for r in runs]),
        "start": _mean([r["curve"][0]["accuracy"] for r in runs]),
        "at_budget": _mean([at_budget(r, budget) for r in runs]),
        "last": _mean([r["curve"][-1]["accuracy"] for r in runs]),
        "last_device_s": _mean([r["curve"][-1]["device_s"] for r in runs]),
        "seeds": len(runs),
    }


def table(measured: dict, runs: dict, budget: float) -> str:
    head = (
        f"| method | export s | .pte MB | .ptd MB | step s | step peak MB | inference MB (same rows) | ratio | "
        f"accuracy at {budget:.0f} device-s | last (device-s) | gain | seeds | uploads |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for method in METHODS:
        m, s = measured[method], summary(runs[method], budget)
        export = "-" if m["export_s"] is None else f"{m['export_s']:.0f}"
        lines.append(
            f"| {method} | {export} | {m['pte_bytes'] / 1e6:.2f} | {m['ptd_bytes'] / 1e6:.0f} | {s['step_s']:.2f} | "
            f"{m['step_mb']:.0f} | {m['inference_mb']:.0f} ({m['rows']} rows) | "
            f"{m['step_mb'] / m['inference_mb']:.2f} | {s['at_budget']:.3f} | {s['last']:.3f} "
            f"({s['last_device_s']:.0f}) | {100 * (s['last'] - s['start']):+.1f} | {s['seeds']} | {UPLOADS[method]} |"
        )
    return "\n".join(lines)


def plot(measured: dict, runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for method, color in zip(METHODS, ("tab:blue", "tab:red"), strict=True):
        curves = runs[method]
        if not curves:
            continue
        steps = [point["device_s"] for point in curves[0]["curve"]]
        mean = [_mean([r["curve"][i]["accuracy"] for r in curves]) for i in range(len(steps))]
        left.plot(steps, mean, marker="o", color=color, label=f"{method} ({len(curves)} seeds)")
        right.scatter(measured[method]["step_mb"], mean[-1], color=color, s=60, label=method)
        right.scatter(measured[method]["inference_mb"], mean[0], color=color, marker="x", s=60)
    left.set(xlabel="device-seconds (steps x median step time)", ylabel="test accuracy (mean over seeds)")
    right.set(
        xlabel="peak memory of a step, MB (x: an inference forward of the same rows, at step 0's accuracy)",
        ylabel="last accuracy (mean over seeds)",
    )
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = learning(args)  # exports both programs on its first runs
    measured = measure_programs(args)
    print(table(measured, runs, args.budget))
    (args.out / "peer.json").write_text(json.dumps({"programs": measured, "runs": runs}, indent=2, default=str))
    if not args.no_plot:
        plot(measured, runs, args.out / "peer.png")
        print(f"peer: the picture is {args.out / 'peer.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
