"""How fast is the exported training step, next to the same step in eager PyTorch?

For one model and each q (E fixed), exports the Mobile MP-LoRA program with the XNNPACK and the portable backend,
then times `forward` (one whole ZO-SGD step) of each program and of the eager step module, interleaved round-robin
after a warm-up, and prints median step times with ratios to eager. Also reports export time, the peak RSS of the
export (measured in a child process per export), and the .pte / .ptd sizes.

    python benchmarks/program.py --model DIR [--q 1 4] [--examples-per-query 1] [--seq-len 64] [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def _export_child(model_dir: str, cfg, out: str, queue) -> None:
    from shared.program import export_program

    manifest = export_program(Path(model_dir), cfg, Path(out), progress=lambda _: None)
    queue.put((manifest, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))


def export_measured(model_dir: Path, cfg, out: Path) -> tuple:
    """Export in a fresh process so that its peak RSS is the export's own → (manifest, peak RSS in MB)."""
    queue = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=_export_child, args=(str(model_dir), cfg, str(out), queue))
    proc.start()
    manifest, peak_mb = queue.get()
    proc.join()
    return manifest, peak_mb


def _inputs(cfg, vocab: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rows = cfg.batch_size
    ids = torch.randint(3, vocab, (rows, cfg.seq_len), generator=gen)
    targets = ids[:, -cfg.answer_len :].clone()
    return [ids, torch.ones_like(ids), targets, torch.tensor([seed]), torch.tensor([1e-4]), torch.tensor([1e-2])]


def _timed(fn, args) -> float:
    start = time.perf_counter()
    fn(args)
    return time.perf_counter() - start


def benchmark(
    model_dir: Path, qs: list[int], per_query: int, seq_len: int, steps: int, workdir: Path, backends: list[str]
) -> list[dict]:
    from executorch.runtime import Runtime

    from device_agent.native_log import runtime_log_filtered
    from shared.hf_models import load_model
    from shared.manifest import ProgramConfig
    from shared.program import build_step_module

    rows = []
    for q in qs:
        runners, info = {}, {}
        for backend in backends:
            cfg = ProgramConfig(q=q, batch_size=q * per_query, seq_len=seq_len, answer_len=1, backend=backend)
            start = time.perf_counter()
            manifest, peak_mb = export_measured(model_dir, cfg, workdir / f"q{q}-{backend}.pte")
            info[backend] = {
                "export_s": time.perf_counter() - start,
                "export_peak_rss_mb": peak_mb,
                "pte_bytes": manifest.pte.size,
                "ptd_bytes": manifest.ptd.size,
            }
            with runtime_log_filtered():
                program = Runtime.get().load_program(
                    workdir / f"q{q}-{backend}.pte", data_path=workdir / manifest.ptd.file
                )
                method = program.load_method("forward")
            runners[backend] = method.execute
        model, _ = load_model(model_dir)
        eager = build_step_module(model, cfg)

        def run_eager(args, step_module=eager):
            with torch.no_grad():
                step_module(*args)

        runners["eager"] = run_eager
        vocab = model.config.vocab_size
        times: dict[str, list[float]] = {name: [] for name in runners}
        for fn in runners.values():  # warm-up
            fn(_inputs(cfg, vocab, 0))
        for k in range(steps):  # interleaved: every runner sees the same machine state, round after round
            for name, fn in runners.items():
                times[name].append(_timed(fn, _inputs(cfg, vocab, k + 1)))
        eager_median = statistics.median(times["eager"])
        for name, samples in times.items():
            median = statistics.median(samples)
            rows.append(
                {
                    "q": q,
                    "E": per_query,
                    "seq_len": seq_len,
                    "runner": name,
                    "step_s": median,
                    "ratio_to_eager": median / eager_median,
                    **info.get(name, {}),
                }
            )
    return rows


def print_table(rows: list[dict]) -> None:
    print(
        f"{'q':>3} {'E':>3} {'runner':>9} {'step s':>9} {'vs eager':>9} {'export s':>9} {'export MB':>10}"
        f" {'.pte KB':>9} {'.ptd MB':>9}"
    )
    for r in rows:
        extra = (
            (
                f"{r['export_s']:9.1f} {r['export_peak_rss_mb']:10.0f} {r['pte_bytes'] / 1e3:9.1f}"
                f" {r['ptd_bytes'] / 1e6:9.1f}"
            )
            if "export_s" in r
            else ""
        )
        print(f"{r['q']:>3} {r['E']:>3} {r['runner']:>9} {r['step_s']:9.4f} {r['ratio_to_eager']:9.2f} {extra}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="Hugging Face model directory")
    parser.add_argument("--q", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--examples-per-query", type=int, default=1, help="E")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per runner")
    parser.add_argument("--backends", nargs="+", default=["xnnpack", "portable"], choices=["xnnpack", "portable"])
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="threads of both torch and ExecuTorch's threadpool (default 1: on a small shared machine "
        "two torch threads were 25x slower than one)",
    )
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool

    torch.set_num_threads(args.threads)
    _unsafe_reset_threadpool(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        rows = benchmark(
            args.model, args.q, args.examples_per_query, args.seq_len, args.steps, Path(tmp), args.backends
        )
    print_table(rows)
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
