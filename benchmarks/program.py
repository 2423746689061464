"""Does the parallel schedule pay off on the device runtime, and does a step cost more memory than inference?

For one model and each cell (batch size, q) it exports, with the real ``export_program``, the training program
with ``--parallel both`` (all 2q paths in one pass) and with ``none`` (2q one-path passes, the MeZO-LoRA way), and
an ``inference`` program: the plain forward of the base model over the same 2q·E rows (``PlainForward``). Then:

- **time**: ``forward`` of each program, and the eager step module (``both``, ``no_grad``), interleaved round-robin
  after a warm-up, for each ``--threads`` count (torch's threads and ExecuTorch's XNNPACK threadpool alike);
  medians and the speed-up of ``both`` over ``none`` (none s / both s).
- **memory**: each program in a fresh process: load it, run ``forward`` once, then the step's peak RSS over the
  RSS before it (``benchmarks.step_time.CpuMemory``: VmHWM reset, malloc_trim), the process's peak, and the
  program's own (that peak over the process's RSS before the program was loaded: the interpreter, torch and the
  runtime's library left out; what the Python runtime allocates to load the program stays in); the ratio of each
  to the inference program's.
- **export**: seconds and peak RSS (a child process per export), ``.pte`` and ``.ptd`` sizes, and the manifest's
  memory estimate (``memory_mb``, what the server's lease filter compares with a device's free memory) next to the
  measured peak.

With ``--optimizers momentum normalized`` the first schedule's program is exported once more per optimizer (runners
``both+momentum``, ...): what each optimizer's update and state cost a step, in time and memory, against ``sgd``'s.

Exports are kept in ``--workdir`` (default: a temporary folder) and reused by a later run with the same folder.

    python -m benchmarks.program --model DIR [--cells 1x1 16x1 16x4] [--seq-len 64] [--threads 1 2] [--steps 10]
        [--quantize none|8da4w] [--schedules both none] [--optimizers momentum normalized]
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
from torch import nn

from shared.backends import OPTIMIZERS

SCHEDULES = ("both", "none")
INFERENCE = "inference"


class PlainForward(nn.Module):
    """Inference: per-example losses of the base model (no LoRA) on the 2q·E rows of a step's paths."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, targets):
        from shared.batch import Batch, position_ids
        from shared.zo import forward_losses

        return forward_losses(self.model, Batch(input_ids, attention_mask, position_ids(attention_mask), targets))

    def example_inputs(self, cfg) -> dict[str, tuple]:
        rows = 2 * cfg.batch_size
        ids = torch.zeros(rows, cfg.seq_len, dtype=torch.long)
        return {"forward": ((ids, torch.ones_like(ids), torch.zeros(rows, cfg.answer_len, dtype=torch.long)), None)}


def program_path(workdir: Path, cfg, kind: str) -> Path:
    """Where this benchmark keeps its ``kind`` program (a schedule, ``schedule+optimizer`` or ``inference``) of
    ``cfg``'s shapes in ``workdir``: one name per shape, reused by a later run."""
    answers = "" if cfg.answer_len == 1 else f"-a{cfg.answer_len}"
    return workdir / f"b{cfg.batch_size}-q{cfg.q}-s{cfg.seq_len}{answers}-{cfg.backend}-{cfg.quantize}-{kind}.pte"


def inference_weights(pte: Path) -> Path:
    """The weights file of an inference program ``pte`` this benchmark exported: a folder of the program's name."""
    from shared.ptd import WEIGHTS_TAG

    return pte.with_suffix("") / f"{WEIGHTS_TAG}.ptd"


def _export_child(model_dir: str, cfg, out: str, kind: str, queue) -> None:
    from shared.files import atomic_write
    from shared.program import export_program, lower

    started = time.perf_counter()
    if kind == INFERENCE:
        from shared.hf_models import load_model
        from shared.quantize import quantize_base

        model, _ = load_model(Path(model_dir), "float32")
        model.config.use_cache = False
        quantize_base(model, cfg.quantize, cfg.group_size)  # inference at the training program's weights
        manager = lower(PlainForward(model), cfg)
        atomic_write(Path(out), manager.write_to_file)
        ptd = inference_weights(Path(out))  # its own weights: no LoRA A, so not the training programs' .ptd
        ptd.parent.mkdir(exist_ok=True)
        manager.write_tensor_data_to_file(str(ptd.parent))
    else:
        manifest = export_program(Path(model_dir), cfg, Path(out), progress=lambda _: None)
        ptd = Path(out).parent / manifest.ptd.file
    info = {
        "export_s": time.perf_counter() - started,
        "export_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "pte_bytes": Path(out).stat().st_size,
        "ptd_bytes": ptd.stat().st_size,
        "ptd": str(ptd),
    }
    Path(out).with_suffix(".export.json").write_text(json.dumps(info))
    queue.put(info)


def export_measured(model_dir: Path, cfg, out: Path, kind: str) -> dict:
    """Export in a fresh process, so that its peak RSS is the export's own; reuses an earlier export in ``out``."""
    done = out.with_suffix(".export.json")
    if done.is_file() and out.is_file():
        return json.loads(done.read_text())
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_export_child, args=(str(model_dir), cfg, str(out), kind, queue))
    proc.start()
    info = queue.get()
    proc.join()
    return info


def _inputs(cfg, vocab: int, seed: int, kind: str) -> list[torch.Tensor]:
    """A step's inputs; for inference, its input_ids, mask and targets with every row twice (the ± pair)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (cfg.batch_size, cfg.seq_len), generator=gen)
    targets = ids[:, -cfg.answer_len :].clone()
    if kind == INFERENCE:
        return [
            torch.cat([ids, ids]),
            torch.ones(2 * cfg.batch_size, cfg.seq_len, dtype=torch.long),
            targets.repeat(2, 1),
        ]
    return [ids, torch.ones_like(ids), targets, torch.tensor([seed]), torch.tensor([1e-4]), torch.tensor([1e-2])]


def _load(pte: Path, ptd: Path, d: int | None):
    """The program's forward, with B set to zeros first for a training program (it carries no B). A training
    program is loaded as the agent's training session loads it (``ProgramSession(evaluate=False)``): without
    ``evaluate``, whose planned memory and packed weights a step does not need."""
    from executorch.runtime import Runtime

    from device_agent.native_log import runtime_log_filtered

    with runtime_log_filtered():
        program = Runtime.get().load_program(pte, data_path=ptd)
        names = sorted(name for name in program.method_names if name != "evaluate")
        methods = {name: program.load_method(name) for name in names}
    if d is not None:
        methods["set_lora_b"].execute([torch.zeros(d)])

    def forward(inputs, _alive=(program, methods)):  # every method stays loaded: they share B's buffer
        return methods["forward"].execute(inputs)

    return forward


def _memory_child(pte: str, ptd: str, d: int | None, cfg, vocab: int, kind: str, queue) -> None:
    from executorch.runtime import Runtime

    import device_agent.native_log  # noqa: F401 - imported by _load: loaded before the baseline
    from benchmarks.step_time import CpuMemory

    _set_threads(1)  # the memory of a step does not depend on who runs it; one thread, as a phone's small core
    Runtime.get()  # the runtime's library in memory before the baseline: its size is not the program's
    probe = CpuMemory()
    probe.start()
    base = probe.before if probe.available else None
    forward = _load(Path(pte), Path(ptd), d)
    forward(_inputs(cfg, vocab, 0, kind))  # warm: the delegate's first run allocates its workspace
    probe = CpuMemory()
    probe.start()
    forward(_inputs(cfg, vocab, 1, kind))
    peak, step = probe.stop()
    queue.put({"run_peak_mb": peak, "run_step_mb": step, "program_mb": None if base is None else peak - base})


def memory_measured(pte: Path, ptd: Path, d: int | None, cfg, vocab: int, kind: str) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_memory_child, args=(str(pte), str(ptd), d, cfg, vocab, kind, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def _timed(fn, args) -> float:
    start = time.perf_counter()
    fn(args)
    return time.perf_counter() - start


def _set_threads(threads: int) -> None:
    """torch's threads and ExecuTorch's threadpool. Only while no program is loaded: an XNNPACK delegate keeps the
    pool it was initialised with, and resetting the pool under it crashed (segfault in libexecutorch_threadpool)."""
    from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool

    torch.set_num_threads(threads)
    _unsafe_reset_threadpool(threads)


def bench_cell(model_dir: Path, batch: int, q: int, seq_len: int, args, workdir: Path) -> list[dict]:
    """Export (or reuse), measure memory, then time every runner of one cell for each thread count."""
    from shared.hf_models import load_model
    from shared.manifest import ProgramConfig
    from shared.program import build_step_module

    model, _ = load_model(model_dir)
    vocab = model.config.vocab_size
    info, cfgs, files = {}, {}, {}
    variants = [f"{args.schedules[0]}+{name}" for name in args.optimizers if name != "sgd"]
    for kind in (*args.schedules, *variants, INFERENCE):
        schedule, _, optimizer = kind.partition("+")
        cfg = ProgramConfig(
            q=q,
            batch_size=batch,
            seq_len=seq_len,
            answer_len=1,
            backend=args.backend,
            parallel=schedule if kind != INFERENCE else "both",
            quantize=args.quantize,
            optimizer=optimizer or "sgd",
        )
        pte = program_path(workdir, cfg, kind)
        info[kind] = export_measured(model_dir, cfg, pte, kind)
        manifest = None if kind == INFERENCE else json.loads(pte.with_suffix(".json").read_text())
        d = None if manifest is None else manifest["lora_size"]
        if manifest is not None:  # the estimate the server's lease filter uses, next to the measured peak
            info[kind]["estimate_mb"] = manifest["memory_mb"]
        info[kind] |= memory_measured(pte, Path(info[kind]["ptd"]), d, cfg, vocab, kind)
        files[kind], cfgs[kind] = (pte, Path(info[kind]["ptd"]), d), cfg
    eager = build_step_module(model, cfgs[args.schedules[0]])

    def run_eager(inputs, step_module=eager):
        with torch.no_grad():
            step_module(*inputs)

    cfgs["eager"] = cfgs[args.schedules[0]]
    kinds = {name: (INFERENCE if name == INFERENCE else "step") for name in cfgs}
    rows = []
    for threads in args.threads:
        _set_threads(threads)  # before loading: the programs are loaded afresh for each thread count
        runners = {kind: _load(*files[kind]) for kind in files} | {"eager": run_eager}
        times: dict[str, list[float]] = {name: [] for name in runners}
        for name, fn in runners.items():  # warm-up
            fn(_inputs(cfgs[name], vocab, 0, kinds[name]))
        for k in range(args.steps):  # interleaved: every runner sees the same machine state, round after round
            for name, fn in runners.items():
                times[name].append(_timed(fn, _inputs(cfgs[name], vocab, k + 1, kinds[name])))
        del runners, fn  # unload the programs before the next thread count resets the pool
        medians = {name: statistics.median(samples) for name, samples in times.items()}
        for name, median in medians.items():
            rows.append(
                {
                    "batch": batch,
                    "q": q,
                    "seq_len": seq_len,
                    "threads": threads,
                    "runner": name,
                    "step_s": median,
                    "none_over_this": medians["none"] / median if "none" in medians else None,
                    **_memory_ratios(info, name),
                    **{k: v for k, v in info.get(name, {}).items() if k != "ptd"},
                }
            )
    return rows


def _memory_ratios(info: dict, name: str) -> dict:
    if name not in info:
        return {}
    ref = info[INFERENCE]
    return {
        "step_mb_vs_inference": info[name]["run_step_mb"] / ref["run_step_mb"] if ref["run_step_mb"] else None,
        "peak_mb_vs_inference": info[name]["run_peak_mb"] / ref["run_peak_mb"],
        "program_mb_vs_inference": info[name]["program_mb"] / ref["program_mb"] if ref["program_mb"] else None,
    }


def _f(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[dict]) -> None:
    print(
        "| batch | q | threads | runner | s/step | none ÷ this | run MB | × inference | run peak MB | × inference "
        "| program MB | × inference | estimate MB | export s | export MB | .pte KB | .ptd MB |"
    )
    print("|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        pte_kb = r["pte_bytes"] / 1e3 if "pte_bytes" in r else None
        ptd_mb = r["ptd_bytes"] / 1e6 if "ptd_bytes" in r else None
        cells = [
            f"{r['step_s']:.4f}",
            _f(r["none_over_this"], ".2f"),
            _f(r.get("run_step_mb"), ".1f"),
            _f(r.get("step_mb_vs_inference"), ".2f"),
            _f(r.get("run_peak_mb"), ".0f"),
            _f(r.get("peak_mb_vs_inference"), ".2f"),
            _f(r.get("program_mb"), ".0f"),
            _f(r.get("program_mb_vs_inference"), ".2f"),
            _f(r.get("estimate_mb"), ".0f"),
            _f(r.get("export_s"), ".0f"),
            _f(r.get("export_peak_rss_mb"), ".0f"),
            _f(pte_kb, ".0f"),
            _f(ptd_mb, ".1f"),
        ]
        print(f"| {r['batch']} | {r['q']} | {r['threads']} | {r['runner']} | " + " | ".join(cells) + " |")


def _cell(text: str) -> tuple[int, int]:
    try:
        batch, q = (int(x) for x in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BATCHxQ, e.g. 16x4, got {text!r}") from None
    if batch < 1 or q < 1 or batch % q:
        raise argparse.ArgumentTypeError(f"{text}: q must divide the batch size")
    return batch, q


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="Hugging Face model directory")
    parser.add_argument("--cells", type=_cell, nargs="+", default=[(1, 1), (16, 1), (16, 4)], help="BATCHxQ ...")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per runner and thread count")
    parser.add_argument("--backend", default="xnnpack", choices=["xnnpack", "portable"])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts to time with")
    parser.add_argument("--quantize", default="none", choices=["none", "8da4w"], help="base weights of every program")
    parser.add_argument(
        "--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES, help="training programs to export"
    )
    parser.add_argument(
        "--optimizers",
        nargs="+",
        default=[],
        choices=OPTIMIZERS,
        help="also the first schedule's program with each of these optimizers (shared.zo_optim)",
    )
    parser.add_argument("--workdir", type=Path, help="keep exports here and reuse them (default: a temp folder)")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        rows = [row for batch, q in args.cells for row in bench_cell(args.model, batch, q, args.seq_len, args, workdir)]
    print_table(rows)
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
