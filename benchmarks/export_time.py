"""Where a training program's export spends its time, stage by stage, and what the pipeline's bookkeeping cuts save.

For one model and one program config it exports the training program twice, each in a fresh process (so that the
peak RSS is that export's own), through the stages of ``shared.lowering``:

- **build**: load the model, inject LoRA, quantize the base (``shared.program.build_step_module``);
- **trace**: ``torch.export`` of every method, the frozen constants tagged for the ``.ptd``;
- **lower**: the edge dialect, XNNPACK taking what it supports (``lowering.to_edge``);
- **emit**: memory planning and the program's bytes (``lowering.emit``);
- **store**: the ``.pte`` and the ``.ptd`` written.

``shipped`` runs the stages as ``export_program`` does; ``plain`` runs lower and emit without
``shared.et_patches.less_bookkeeping`` (eager graph-module code, deep-copied provenance); ``executorch-edge``
decomposes each method twice as ExecuTorch's own edge path does (functionalized first) instead of once
(``shared.lowering._decomposed_once``), and must give the same bytes too; ``hf-layers`` is ``shipped`` with Hugging
Face's own Llama norm, attention and MLP in place of ``shared.layers``' (the layer XNNPACK takes whole); ``sdpa`` is
``hf-layers`` with torch's scaled_dot_product_attention in place of the additive-mask attention
(``shared.hf_models.ATTENTION``); ``one-process`` is ``shipped`` with every method lowered in the export's own
process (``MOBIZO_LOWERING_PROCESSES=1``) where ``shipped`` lowers some in a second one on a machine of two CPUs or
more (``shared.lowering.lowering_processes``), and must give the same bytes. Each prints the graph's node count per
method, the XNNPACK partitions per method, the peak RSS (overall and by the end of each stage), the peak PSS of the
export's processes together (sampled every 0.2 s: what the export holds when its lowering runs in two processes),
and the sha256 of the ``.pte`` and the ``.ptd``: ``shipped`` and ``plain`` must be the same bytes. ``--keep DIR``
keeps each program (``VARIANT.pte`` and its manifest), for ``benchmarks.program_profile`` to time their steps side
by side.

    python -m benchmarks.export_time --model DIR [--q 4] [--batch-size 16] [--seq-len 64] [--quantize none|8da4w]
        [--variants shipped plain one-process executorch-edge hf-layers sdpa] [--keep DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

VARIANTS = ("shipped", "plain", "one-process", "executorch-edge", "hf-layers", "sdpa")
SAME_BYTES = ("shipped", "plain", "one-process", "executorch-edge")  # variants that must emit the same program
STAGES = ("build", "trace", "lower", "emit", "store")


def _partitions(manager) -> dict[str, int]:
    """XNNPACK delegate calls per method of the emitted program."""
    return {
        plan.name: sum(type(i.instr_args).__name__ == "DelegateCall" for i in plan.chains[0].instructions)
        for plan in manager.executorch_program.execution_plan
    }


def _export_child(model_dir: str, cfg, variant: str, out_dir: str, queue) -> None:
    from shared import lowering
    from shared.hf_models import load_model
    from shared.layers import unfold_llama_layers
    from shared.program import build_step_module, write_manifest

    seconds, peaks = {}, {}
    clock = time.perf_counter()

    def lap(stage: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        seconds[stage] = now - clock
        peaks[stage] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        clock = now

    if variant == "one-process":
        os.environ[lowering.LOWERING_PROCESSES_ENV] = "1"
    if variant == "executorch-edge":  # ExecuTorch's own edge path: functionalize, then decompose
        lowering._kept_whole = lambda programs, partitioner: None
    model, tokenizer = load_model(Path(model_dir), "float32")
    if variant in ("hf-layers", "sdpa"):
        unfold_llama_layers(model)
    if variant == "sdpa":
        model.config._attn_implementation = "sdpa"
    step = build_step_module(model, cfg)
    lap("build")
    programs = lowering.trace(
        step, step.example_inputs(cfg), cfg.backend, lowering.frozen_weights_tag, cfg.quantize != "none"
    )
    nodes = {name: len(program.graph.nodes) for name, program in programs.items()}
    lap("trace")
    bookkeeping = contextlib.nullcontext if variant == "plain" else lowering.less_bookkeeping
    edge = lowering.to_edge(programs, cfg.backend, bookkeeping, quantize=cfg.quantize)
    lap("lower")
    manager = lowering.emit(edge, lowering.frozen_weights_tag, bookkeeping=bookkeeping)
    lap("emit")
    out_pte = Path(out_dir) / f"{variant}.pte"
    emitted = lowering.store(manager, out_pte, Path(out_dir), tokenizer)
    lap("store")
    write_manifest(Path(model_dir), cfg, step, emitted, out_pte, sum(seconds.values()))
    queue.put(
        {
            "variant": variant,
            "seconds": seconds,
            "total_s": sum(seconds.values()),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "peak_by_stage_mb": peaks,
            "nodes": nodes,
            "partitions": _partitions(manager),
            "pte_sha256": emitted.pte.sha256,
            "ptd_sha256": emitted.ptd.sha256,
            "pte_kb": emitted.pte.size / 1024,
            "ptd_mb": emitted.ptd.size / 2**20,
        }
    )


def _tree_pss_kb(pid: int) -> int:
    """Proportional set size of ``pid`` and its descendants together, in kB (pages they share counted once)."""
    total = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as file:
            total += next((int(line.split()[1]) for line in file if line.startswith("Pss:")), 0)
        with open(f"/proc/{pid}/task/{pid}/children") as file:
            children = [int(child) for child in file.read().split()]
    except OSError:  # exited meanwhile
        return total
    return total + sum(_tree_pss_kb(child) for child in children)


class PeakPss:
    """The peak of ``_tree_pss_kb(pid)``, sampled every ``every_s`` seconds in a thread until ``stop()`` → MB."""

    def __init__(self, pid: int, every_s: float = 0.2) -> None:
        self.peak_kb, self._done = 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(pid, every_s), daemon=True)
        self._thread.start()

    def _sample(self, pid: int, every_s: float) -> None:
        while not self._done.wait(every_s):
            self.peak_kb = max(self.peak_kb, _tree_pss_kb(pid))

    def stop(self) -> float:
        self._done.set()
        self._thread.join()
        return self.peak_kb / 1024


def export_measured(model_dir: Path, cfg, variant: str, keep: Path | None) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = keep or Path(tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        proc = ctx.Process(target=_export_child, args=(str(model_dir), cfg, variant, str(out_dir), queue))
        proc.start()
        pss = PeakPss(proc.pid)
        info = queue.get()
        proc.join()
        info["peak_pss_mb"] = pss.stop()
    return info


def print_table(rows: list[dict]) -> None:
    print("| stage | " + " | ".join(row["variant"] for row in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for stage in STAGES:
        print(f"| {stage} s | " + " | ".join(f"{row['seconds'][stage]:.1f}" for row in rows) + " |")
    print("| **total s** | " + " | ".join(f"**{row['total_s']:.1f}**" for row in rows) + " |")
    print("| peak RSS MB | " + " | ".join(f"{row['peak_rss_mb']:,.0f}" for row in rows) + " |")
    print("| peak PSS MB, all processes | " + " | ".join(f"{row['peak_pss_mb']:,.0f}" for row in rows) + " |")
    for stage in STAGES:
        peaks = " | ".join(f"{row['peak_by_stage_mb'][stage]:,.0f}" for row in rows)
        print(f"| peak RSS MB by the end of {stage} | {peaks} |")
    for key in ("nodes", "partitions"):
        for method in rows[0][key]:
            print(f"| {key}: {method} | " + " | ".join(str(row[key][method]) for row in rows) + " |")
    print("| .pte KB / .ptd MB | " + " | ".join(f"{row['pte_kb']:.0f} / {row['ptd_mb']:.0f}" for row in rows) + " |")
    print("| .pte sha256 | " + " | ".join(row["pte_sha256"][:16] for row in rows) + " |")
    print("| .ptd sha256 | " + " | ".join(row["ptd_sha256"][:16] for row in rows) + " |")
    if _differ(rows):
        print("THE PROGRAMS DIFFER: a bookkeeping cut, the one decomposition or the second process changed the program")


def _differ(rows: list[dict]) -> bool:
    same = [row for row in rows if row["variant"] in SAME_BYTES]
    return len({(row["pte_sha256"], row["ptd_sha256"]) for row in same}) > 1


def main(argv: list[str] | None = None) -> int:
    from shared.defaults import alpha_for
    from shared.manifest import ProgramConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="Hugging Face model directory")
    parser.add_argument("--q", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--quantize", default="none", choices=["none", "8da4w"])
    parser.add_argument("--variants", nargs="+", default=["shipped", "plain"], choices=VARIANTS)
    parser.add_argument("--keep", type=Path, help="keep the programs in this folder (VARIANT.pte)")
    args = parser.parse_args(argv)
    # The classification program of a two-answer task (the candidates' ids do not change the export's cost).
    cfg = ProgramConfig(
        q=args.q,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        answer_len=1,
        rank=args.rank,
        alpha=alpha_for(args.rank),
        quantize=args.quantize,
        objective="classification",
        candidates=(1, 2),
    )
    rows = []
    for variant in args.variants:
        rows.append(export_measured(args.model, cfg, variant, args.keep))
        print(f"{variant}: {rows[-1]['total_s']:.1f} s", flush=True)
    print_table(rows)
    return 1 if _differ(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
